"""Logit bias and repetition / presence / frequency penalties on the worker, against oracles.

Repetition penalty and logit bias: Hugging Face `generate` with its own logits processors
(`RepetitionPenaltyLogitsProcessor`, `SequenceBiasLogitsProcessor`), greedy. Presence and
frequency penalties: a reference loop over HF's logits (vLLM's definition: output tokens
only). Ours run through the toy scheduler with chunked prefill, placeholder decodes (the
device-side path async scheduling uses) and swap / recompute preemption, in a batch that
mixes requests with and without the features.
"""

from __future__ import annotations

import pytest
import torch

from stepahead.plan import SamplingParams
from testing.checkpoints import VARIANTS, build_checkpoint
from tests.model.driver import ToyRequest, ToyScheduler
from tests.model.oracle import assert_matches_hf, random_prompts
from worker_service.logits_processing import LogitsProcessing
from worker_service.model_runner import ModelRunner

NEW = 16
BIAS = ((7, 4.0), (100, -50.0), (300, 2.5))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model_type, overrides = VARIANTS["llama_tied_gqa4"]
    path = tmp_path_factory.mktemp("penalties")
    hf = build_checkpoint(path, model_type, seed=5, **overrides)
    return path, hf


@torch.no_grad()
def hf_generate(hf, prompt: list[int], **kw) -> tuple[list[int], list[float]]:
    """HF greedy with its own processors; gaps are over the processed logits."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                      do_sample=False, pad_token_id=0, output_logits=False, output_scores=True,
                      return_dict_in_generate=True, **kw)
    gaps = [float((s[0].topk(2).values[0] - s[0].topk(2).values[1])) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


class PresenceFrequency:
    """Reference logits processor for HF `generate`: vLLM's definition over output tokens,
    logit[t] -= frequency * count(t in output) + presence * (t in output)."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.num_prompt:]
        counts = torch.bincount(out, minlength=scores.shape[-1]).to(scores.dtype)  # [vocab]
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def reference_presence_frequency(hf, prompt: list[int], presence: float, frequency: float):
    from transformers import LogitsProcessorList

    return hf_generate(hf, prompt, logits_processor=LogitsProcessorList([
        PresenceFrequency(len(prompt), presence, frequency)]))


def run_ours(path, prompts, samplings, **driver_kw) -> dict[str, list[int]]:
    runner = ModelRunner(path, num_blocks=120, num_host_blocks=120, block_size=8)
    sched = ToyScheduler(runner, chunk=16, token_budget=48, max_running=6, **driver_kw)
    for i, (p, s) in enumerate(zip(prompts, samplings)):
        sched.add(ToyRequest(f"r{i}", p, NEW, arrival_step=i, sampling=s))
    sched.run()
    assert not runner.logits_processing.state.slots  # every finished request's state was freed
    return {r.request_id: r.output for r in sched.finished}, sched.stats


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, **kw)


def test_repetition_penalty_and_logit_bias_equal_hf_processors(checkpoint, preempt_every=3):
    path, hf = checkpoint
    prompts = random_prompts(seed=21, lens=[5, 40, 30, 12])
    kinds = [  # (ours, HF generate kwargs); plain rows share the batch with penalised ones
        (greedy(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
        (greedy(), {}),
        (greedy(logit_bias=BIAS), dict(sequence_bias={(t,): b for t, b in BIAS})),
        (greedy(repetition_penalty=0.7, logit_bias=BIAS),
         dict(repetition_penalty=0.7, sequence_bias={(t,): b for t, b in BIAS})),
    ]
    samplings = [kinds[i % len(kinds)][0] for i in range(len(prompts))]
    ours, stats = run_ours(path, prompts, samplings, preempt_every=preempt_every)
    assert stats.placeholder_decodes > 0
    if preempt_every:
        assert stats.swaps >= 1 and stats.recomputes >= 1
    for i, prompt in enumerate(prompts):
        expected, gaps = hf_generate(hf, prompt, **kinds[i % len(kinds)][1])
        assert_matches_hf(ours[f"r{i}"], expected, gaps, f"r{i}")
    penalised = ours["r0"]
    plain, _ = hf_generate(hf, prompts[0])
    assert penalised != plain  # the penalty changed something (else the test proves nothing)


def test_presence_and_frequency_penalties_equal_the_reference(checkpoint, preempt_every=3):
    path, hf = checkpoint
    prompts = random_prompts(seed=22, lens=[9, 40, 20, 30])
    settings = [(1.5, 0.0), (0.0, 0.8), (0.5, 0.5), (-1.0, 0.3)]
    samplings = [greedy(presence_penalty=p, frequency_penalty=f) for p, f in settings]
    ours, stats = run_ours(path, prompts, samplings, preempt_every=preempt_every)
    if preempt_every:
        assert stats.swaps >= 1 and stats.recomputes >= 1
    changed = 0
    for i, (prompt, (p, f)) in enumerate(zip(prompts, settings)):
        expected, gaps = reference_presence_frequency(hf, prompt, p, f)
        assert_matches_hf(ours[f"r{i}"], expected, gaps, f"r{i}")
        changed += expected != reference_presence_frequency(hf, prompt, 0.0, 0.0)[0]
    assert changed >= 2


def test_only_penalty_rows_hold_state_and_sampled_ids_are_counted_on_the_device(checkpoint):
    from stepahead.plan import NewRequest, StepPlan

    path, _ = checkpoint
    both = ModelRunner(path, num_blocks=40, block_size=8)
    plan = StepPlan(0, new_requests=(
        NewRequest("a", (1, 2, 3), greedy(), (0,), 0, 3, 3),
        NewRequest("b", (1, 2, 3), greedy(frequency_penalty=2.0), (1,), 0, 3, 3),
    ))
    sampled = both.execute(plan).sampled_token_ids
    state = both.logits_processing.state
    assert list(state.slots) == ["b"]
    counts = state.counts[state.slots["b"]]
    assert int(counts.sum()) == 1 and int(counts[sampled["b"]]) == 1
    alone = ModelRunner(path, num_blocks=40, block_size=8)
    alone.execute(StepPlan(0, new_requests=(NewRequest("a", (1, 2, 3), greedy(), (0,), 0, 3, 3),)))
    torch.testing.assert_close(both.logits_of("a"), alone.logits_of("a"), rtol=0, atol=1e-5)


@pytest.mark.parametrize("penalty", [1.7, 0.6])
def test_repetition_penalty_matches_hf_on_negative_logits(penalty):
    """HF's RepetitionPenaltyLogitsProcessor divides a seen token's positive logit by the
    penalty and multiplies a negative one (both move away from being picked for penalty > 1);
    dividing negative logits too would move them towards it."""
    from transformers import RepetitionPenaltyLogitsProcessor

    vocab = 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * 4.0  # [3, vocab]
    prompts = [[1, 5, 9], [2, 3], [40, 41, 42, 43]]
    outputs = [[5, 7, 11], [60], [0, 1]]
    for i, (p, o) in enumerate(zip(prompts, outputs)):  # seen tokens of both signs in every row
        seen = p + o
        logits[i, seen[0]], logits[i, seen[1]] = -abs(logits[i, seen[0]]) - 0.5, abs(logits[i, seen[1]]) + 0.5
    runner_side = LogitsProcessing(vocab, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        runner_side.register(f"r{i}", params, p + o, len(p))
    ours = runner_side.apply(logits, [f"r{i}" for i in range(3)], [params] * 3)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        seen = p + o
        assert (logits[i, seen] < 0).any() and (logits[i, seen] > 0).any()  # the test covers both signs
        expected = hf(torch.tensor([seen]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], expected)
