"""N-gram speculative decoding is invisible in greedy output: with speculation (K = 2, 4,
async and sync) every request gets exactly the tokens it gets without, which are Hugging
Face's; also under preemption (recompute and swap), prefix hits, penalties, min_tokens,
stop ids cut inside an accepted run and max_tokens boundaries.

Real scheduler core + real ModelRunner (random-init Llama) in one process (local_engine);
`check_integrity()` runs after every step. Prompts repeat themselves so that the n-gram
proposer finds drafts and the random model accepts some of them (asserted).
"""

from __future__ import annotations

import random

import pytest

from scheduler_service.core.config import PreemptionMode, SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import FinishReason
from stepahead.plan import SamplingParams
from stepahead.speculative import SpeculativeConfig
from tests.integration.local_engine import LocalEngine
from testing.checkpoints import VOCAB, build_checkpoint
from tests.model.oracle import assert_matches_hf, hf_greedy
from worker_service.model_runner import ModelRunner

BLOCK = 4
MAX_NEW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec-llama")
    hf = build_checkpoint(path, "llama", seed=3, num_attention_heads=4, num_key_value_heads=2)
    return path, hf


def engine(path, k: int, async_on: bool, num_blocks: int = 256, **overrides) -> LocalEngine:
    spec = SpeculativeConfig(k, 1, 3) if k else None
    runner = ModelRunner(path, block_size=BLOCK, num_blocks=num_blocks, num_host_blocks=256, speculative_config=spec)
    config = SchedulerConfig(
        num_gpu_blocks=num_blocks, num_cpu_blocks=256, max_model_len=runner.max_model_len, block_size=BLOCK,
        max_num_batched_tokens=64, async_scheduling=async_on, eos_token_ids=(), num_speculative_tokens=k,
        **overrides,
    )
    return LocalEngine(runner, config)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that contain their own text again (what prompt lookup is for), and one random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        unit = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 9))]
        out.append((unit * 3)[: rng.randint(12, 26)] if i % 3 else [rng.randrange(VOCAB) for _ in range(15)])
    return out


def run(path, k: int, async_on: bool, requests, **kw) -> LocalEngine:
    e = engine(path, k, async_on, **kw)
    for i, (prompt, sampling) in enumerate(requests):
        e.add(Request(f"r{i}", prompt, sampling))
    e.run()
    e.assert_no_leaks()
    return e


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_speculated(e: LocalEngine) -> None:
    counts = e.scheduler.counters()
    drafts, accepted = counts["spec_num_draft_tokens"], counts["spec_num_accepted_tokens"]
    assert 0 < accepted < drafts, f"the run must accept and reject drafts: {accepted} of {drafts}"
    assert any(r.num_draft_tokens for p in e.plans for r in p.running)


def test_greedy_equals_plain_and_hugging_face(checkpoint):
    path, hf = checkpoint
    prompts = repetitive_prompts(4, seed=1)
    want = hf_greedy(hf, prompts, MAX_NEW)
    requests = [(p, greedy()) for p in prompts]
    plain = run(path, 0, True, requests)
    for k, async_on in ((2, False), (4, True)):
        e = run(path, k, async_on, requests)
        assert_speculated(e)
        assert e.outputs == plain.outputs, f"K={k} async={async_on}"
        assert e.scheduler.counters()["num_steps"] < plain.scheduler.counters()["num_steps"]
    for i, p in enumerate(prompts):
        assert_matches_hf(plain.outputs[f"r{i}"], want.tokens[i], want.gaps[i], f"prompt {i}")


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, pytest.param(PreemptionMode.SWAP, marks=pytest.mark.slow)])
def test_preemption_and_prefix_hits(checkpoint, mode):
    path, _ = checkpoint
    shared = repetitive_prompts(3, seed=2)[1]
    prompts = [shared + p[:5] for p in repetitive_prompts(5, seed=3)]  # a cached prefix, then their own text
    requests = [(p, greedy()) for p in prompts]
    plain = run(path, 0, False, requests)
    e = run(path, 4, True, requests, num_blocks=20, preemption_mode=mode)
    stats = e.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0, stats
    assert_speculated(e)
    assert e.outputs == plain.outputs


def test_stops_inside_an_accepted_run_and_max_tokens(checkpoint):
    path, _ = checkpoint
    prompts = repetitive_prompts(4, seed=4)
    probe = run(path, 0, False, [(p, greedy()) for p in prompts])
    requests = []
    for i, p in enumerate(prompts):
        out = probe.outputs[f"r{i}"]
        requests.append((p, greedy(stop_token_ids=(out[9],))))  # finishes at the first out[9]
        requests.append((p, greedy(max_tokens=(1, 2, 5, 9)[i])))
    plain = run(path, 0, True, requests)
    for async_on in (False, True):
        e = run(path, 4, async_on, requests)
        assert e.outputs == plain.outputs
        assert e.finish == plain.finish
    assert FinishReason.STOP in plain.finish.values() and FinishReason.LENGTH in plain.finish.values()
    lengths = [len(plain.outputs[f"r{2 * i + 1}"]) for i in range(4)]
    assert lengths == [1, 2, 5, 9]


def test_penalties_and_min_tokens(checkpoint):
    path, _ = checkpoint
    prompts = repetitive_prompts(4, seed=5)
    probe = run(path, 0, False, [(p, greedy()) for p in prompts])
    requests = [
        (prompts[0], greedy(repetition_penalty=1.3)),
        (prompts[1], greedy(frequency_penalty=0.5, presence_penalty=0.3)),
        (prompts[2], greedy(min_tokens=12, stop_token_ids=(probe.outputs["r2"][3],))),
        (prompts[3], greedy(logit_bias=((probe.outputs["r3"][0], 2.0),))),
    ]
    plain = run(path, 0, True, requests)
    for async_on in (False, True):
        e = run(path, 3, async_on, requests)
        assert e.outputs == plain.outputs
    assert plain.outputs["r0"] != probe.outputs["r0"], "the penalty changed nothing: a weak test"


def test_logprobs_with_speculation_equal_plain_logprobs(checkpoint):
    """A request asking for logprobs speculates, and every token it emits (accepted drafts and
    the sampled token) gets the raw logprob and top k of its verified position: the same
    tokens and logprobs (within 1e-5) as without speculation, one per token in each event."""
    path, _ = checkpoint
    prompts = repetitive_prompts(3, seed=6)
    requests = [(prompts[0], greedy(logprobs=3)), (prompts[1], greedy(logprobs=0)), (prompts[2], greedy())]
    plain = run(path, 0, True, requests)
    for async_on in (True, False):
        e = engine(path, 4, async_on)
        for i, (prompt, sampling) in enumerate(requests):
            e.add(Request(f"r{i}", prompt, sampling))
        multi = 0  # events of a logprobs request carrying accepted drafts
        while e.scheduler.has_unfinished_requests() or e.pending:
            for event in e.step():
                asks = event.request_id != "r2"
                assert len(event.logprobs) == (len(event.new_token_ids) if asks else 0)
                multi += asks and len(event.new_token_ids) > 1
        e.assert_no_leaks()
        assert_speculated(e)
        assert multi > 0, "no accepted draft of a logprobs request: a weak test"
        assert e.outputs == plain.outputs
        for rid in ("r0", "r1"):
            assert [lp.token_id for lp in e.logprobs[rid]] == e.outputs[rid]
            for got, want in zip(e.logprobs[rid], plain.logprobs[rid], strict=True):
                assert got.token_id == want.token_id
                assert abs(got.logprob - want.logprob) < 1e-5
                assert [t for t, _ in got.top] == [t for t, _ in want.top]
                assert all(abs(g - w) < 1e-5 for (_, g), (_, w) in zip(got.top, want.top, strict=True))
