"""Async scheduling is invisible: every scenario gives the same tokens as the synchronous loop.

Real scheduler core + real ModelRunner (random-init Llama) in one process; see local_engine.
"""

from __future__ import annotations

import random

import pytest

from scheduler_service.core.config import PreemptionMode, SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import FinishReason
from stepahead.plan import SamplingParams
from tests.integration.local_engine import LocalEngine
from testing.checkpoints import VOCAB, build_checkpoint
from worker_service.model_runner import ModelRunner

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("async-llama")
    build_checkpoint(path, "llama", seed=3, num_attention_heads=4, num_key_value_heads=2)
    return path


def engine(model_dir, async_on: bool, num_blocks: int = 256, **overrides) -> LocalEngine:
    runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=num_blocks, num_host_blocks=256)
    config = SchedulerConfig(
        num_gpu_blocks=num_blocks, num_cpu_blocks=256, max_model_len=runner.max_model_len, block_size=BLOCK,
        max_num_batched_tokens=64, async_scheduling=async_on, eos_token_ids=(), **overrides,
    )
    return LocalEngine(runner, config)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run_both(model_dir, requests: list[tuple[list[int], SamplingParams]], **kw) -> tuple[LocalEngine, LocalEngine]:
    engines = []
    for async_on in (False, True):
        e = engine(model_dir, async_on, **kw)
        for i, (prompt, sampling) in enumerate(requests):
            e.add(Request(f"r{i}", prompt, sampling))
        e.run()
        e.assert_no_leaks()
        engines.append(e)
    return engines[0], engines[1]


def test_eos_sampled_while_the_next_step_is_planned(model_dir):
    prompt = prompts(1, seed=1)[0]
    alone = engine(model_dir, False)
    alone.add(Request("probe", prompt, greedy(12)))
    alone.run()
    stop_token = alone.outputs["probe"][5]
    sync, asyn = run_both(model_dir, [(prompt, greedy(12, stop_token_ids=(stop_token,)))])
    want = alone.outputs["probe"][: alone.outputs["probe"].index(stop_token) + 1]
    assert sync.outputs["r0"] == asyn.outputs["r0"] == want
    assert asyn.finish["r0"] is FinishReason.STOP
    # the async scheduler had already planned a decode for r0 past the stop token
    sampled_steps = [p for p in asyn.plans if any(r.request_id == "r0" for r in p.running)]
    assert sum(r.input_is_placeholder for p in asyn.plans for r in p.running) > 0
    assert len(sampled_steps) >= len(want), "the speculative extra step was never planned"


def test_max_tokens_boundary_schedules_no_extra_step(model_dir):
    reqs = [(p, greedy(n)) for p, n in zip(prompts(4, seed=2), (1, 2, 5, 9))]
    sync, asyn = run_both(model_dir, reqs)
    for i, (prompt, sampling) in enumerate(reqs):
        rid = f"r{i}"
        assert sync.outputs[rid] == asyn.outputs[rid]
        assert len(asyn.outputs[rid]) == sampling.max_tokens
        steps = sampling_steps(asyn.plans, rid)
        assert steps == sampling.max_tokens, f"{rid}: {steps} sampling steps for max_tokens {sampling.max_tokens}"


def sampling_steps(plans, rid: str) -> int:
    """How many planned steps sample a token for rid (the worker's rule in stepahead/plan.py)."""
    computed = known = samples = 0
    for plan in plans:
        for r in plan.new_requests:
            if r.request_id == rid:
                computed, known = r.num_computed_tokens + r.num_scheduled_tokens, len(r.token_ids)
                samples, known = (samples + 1, known + 1) if computed >= known else (samples, known)
        for r in plan.running:
            if r.request_id == rid:
                computed += r.num_scheduled_tokens
                samples, known = (samples + 1, known + 1) if computed >= known else (samples, known)
    return samples


def test_abort_while_two_steps_are_in_flight(model_dir):
    reqs = [(p, greedy(20)) for p in prompts(3, seed=3)]
    sync, _ = run_both(model_dir, reqs)
    e = engine(model_dir, True)
    for i, (prompt, sampling) in enumerate(reqs):
        e.add(Request(f"r{i}", prompt, sampling))
    for _ in range(4):
        e.step()
    e.plan_ahead()
    assert e.pending == 2, "the async window should hold two plans"
    committed_before = list(e.outputs["r1"])
    event = e.scheduler.abort("r1")
    assert event is not None and event.finish_reason is FinishReason.ABORT
    e.run()
    assert e.outputs["r1"] == committed_before, "tokens of an aborted request were committed"
    assert committed_before == sync.outputs["r1"][: len(committed_before)]
    for rid in ("r0", "r2"):
        assert e.outputs[rid] == sync.outputs[rid]
    e.assert_no_leaks()


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preemption_while_in_flight(model_dir, mode):
    reqs = [(p, greedy(24)) for p in prompts(6, seed=4, lo=10, hi=30)]
    sync_big, _ = run_both(model_dir, reqs)  # roomy pool: no preemption
    small = dict(num_blocks=24, preemption_mode=mode)
    sync, asyn = run_both(model_dir, reqs, **small)
    assert asyn.scheduler.stats().num_preemptions > 0 and sync.scheduler.stats().num_preemptions > 0
    for i in range(len(reqs)):
        assert sync.outputs[f"r{i}"] == asyn.outputs[f"r{i}"] == sync_big.outputs[f"r{i}"]


def test_requests_join_and_leave_every_step(model_dir):
    rng = random.Random(5)
    reqs = [(p, greedy(rng.randint(1, 12))) for p in prompts(16, seed=5, lo=1, hi=30)]
    results = []
    for async_on in (False, True):
        e = engine(model_dir, async_on)

        def arrive(step: int, e=e) -> None:
            if step < len(reqs):
                e.add(Request(f"r{step}", *reqs[step]))

        e.run(before_step=arrive)
        e.assert_no_leaks()
        results.append(e.outputs)
    assert results[0] == results[1]
    assert all(len(results[1][f"r{i}"]) == s.max_tokens for i, (_, s) in enumerate(reqs))


def test_seeded_sampling_is_the_same_in_both_modes(model_dir):
    reqs = [(p, SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=16))
            for i, p in enumerate(prompts(6, seed=6))]
    sync, asyn = run_both(model_dir, reqs)
    assert sync.outputs == asyn.outputs
    assert len({tuple(v) for v in asyn.outputs.values()}) > 1


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_penalties_and_bias_are_the_same_in_both_modes_with_preemption(model_dir, mode):
    """The penalty counts are updated on the device, so a step planned before the previous
    token reached the host still penalises it; preempted requests rebuild their counts."""
    features = [
        dict(repetition_penalty=1.4), dict(frequency_penalty=0.7), dict(presence_penalty=1.1),
        dict(logit_bias=((3, 5.0), (17, -100.0))), {}, dict(repetition_penalty=0.8, frequency_penalty=0.3),
    ]
    reqs = [(p, SamplingParams(temperature=0.8, seed=7 + i, max_tokens=24, **features[i]))
            for i, p in enumerate(prompts(6, seed=8, lo=10, hi=30))]
    reqs += [(p, greedy(24, **f)) for p, f in zip(prompts(6, seed=9, lo=10, hi=30), features)]
    sync_big, _ = run_both(model_dir, reqs)  # roomy pool: no preemption
    sync, asyn = run_both(model_dir, reqs, num_blocks=40, preemption_mode=mode)
    assert asyn.scheduler.stats().num_preemptions > 0
    assert sum(r.input_is_placeholder for p in asyn.plans for r in p.running) > 0
    assert sync.outputs == asyn.outputs == sync_big.outputs
    plain, _ = run_both(model_dir, [(p, greedy(24)) for p, _ in reqs[6:]])
    assert sum(plain.outputs[f"r{i}"] != sync_big.outputs[f"r{i + 6}"] for i in range(6)) >= 3


def _values(lps) -> list[float]:
    return [v for lp in lps for v in (lp.logprob, *(x for _, x in lp.top))]


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_logprobs_are_the_same_in_both_modes_with_preemption_and_chunks(model_dir, mode):
    """Sampled and prompt logprobs: equal in async and sync, with and without preemption;
    each prompt position is delivered exactly once, chunk by chunk, even when recomputed."""
    asks = [dict(logprobs=3, prompt_logprobs=2), dict(logprobs=0), {}, dict(prompt_logprobs=0)]
    reqs = [(p, SamplingParams(temperature=0.8, seed=11 + i, max_tokens=10, repetition_penalty=1.2, **asks[i % 4]))
            for i, p in enumerate(prompts(5, seed=10, lo=16, hi=30))]
    chunked = dict(long_prefill_token_threshold=8)
    sync_big, _ = run_both(model_dir, reqs, **chunked)
    sync, asyn = run_both(model_dir, reqs, num_blocks=24, preemption_mode=mode, **chunked)
    assert asyn.scheduler.stats().num_preemptions > 0
    for i, (prompt, sampling) in enumerate(reqs):
        rid = f"r{i}"
        assert sync.outputs[rid] == asyn.outputs[rid] == sync_big.outputs[rid]
        for e in (sync, asyn):
            lps = e.logprobs[rid]
            assert len(lps) == (len(e.outputs[rid]) if sampling.logprobs is not None else 0)
            assert [lp.token_id for lp in lps] == e.outputs[rid][: len(lps)]
            assert _values(lps) == pytest.approx(_values(sync_big.logprobs[rid]), abs=1e-4)
            parts = e.prompt_logprobs[rid]
            if sampling.prompt_logprobs is None:
                assert not parts
                continue
            assert len(parts) > 1  # one part per prefill chunk
            positions = [p.start + j for p in parts for j in range(len(p.entries))]
            assert positions == list(range(1, len(prompt)))  # each once, in order
            entries = [lp for p in parts for lp in p.entries]
            assert [lp.token_id for lp in entries] == prompt[1:]
            reference = [lp for p in sync_big.prompt_logprobs[rid] for lp in p.entries]
            assert _values(entries) == pytest.approx(_values(reference), abs=1e-4)
