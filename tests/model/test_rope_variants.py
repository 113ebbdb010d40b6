"""Greedy tokens of the rope variants (`testing/checkpoints.py` ROPE_VARIANTS) equal HF `generate`
on both sides of the trained length (32), through chunked prefill, joins and preemption.

HF's generate runs one prompt at a time here: dynamic and longrope pick their frequencies in HF
by the largest position of the forward, which in a left-padded batch is the longest prompt's.
For those two types the prompts stay within the trained length and the generations cross it:
that is where HF's rotation of each position is fixed and ours (`worker_service/layers/rotary.py`) is
the same. A longer prompt HF rotates whole by its length, differently from its own later
tokens; we keep each position's one rotation, so no equality is claimed there.

Phi-3 with longrope: HF's `Phi3ForCausalLM.prepare_inputs_for_generation` also drops its cache
when a sequence first exceeds the trained length and recomputes it all by the long factors. A
paged cache keeps the keys it wrote, so equality with HF's generate holds only for sequences
within the trained length (tested here); past it, each position's rotation is checked against
HF's rotary function in `tests/unit/test_rope.py`.
"""

from __future__ import annotations

import pytest

from testing.checkpoints import ROPE_VARIANTS, build_checkpoint
from tests.model.driver import ToyRequest, ToyScheduler
from tests.model.oracle import HFGreedy, assert_matches_hf, hf_greedy, random_prompts
from worker_service.model_runner import ModelRunner

TRAINED = 32
MAX_NEW = 24
ACROSS = [3, 20, 31, 33, 50, 70]  # prompts on both sides (types whose rotation ignores the length)
WITHIN = [3, 20, 31]  # + MAX_NEW: every generation crosses position 32 (dynamic, longrope)
SHORT = [3, 6, 8]  # + MAX_NEW: every sequence ends within the trained length (Phi-3 longrope)
PROMPT_LENS = {"llama_dynamic": WITHIN, "llama_longrope": WITHIN + [TRAINED],  # 32: still the short factors
               "phi3_longrope": SHORT, "phi3_partial_longrope": SHORT}


@pytest.fixture(scope="module", params=sorted(ROPE_VARIANTS))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = ROPE_VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(path, model_type, **overrides)
    prompts = random_prompts(len(request.param), PROMPT_LENS.get(request.param, ACROSS))
    one_by_one = [hf_greedy(hf, [p], MAX_NEW) for p in prompts]
    expected = HFGreedy([g.tokens[0] for g in one_by_one], [g.gaps[0] for g in one_by_one])
    return request.param, path, prompts, expected


def test_rope_variant_matches_hf_generate_across_the_trained_length(checkpoint):
    name, path, prompts, expected = checkpoint
    runner = ModelRunner(path, num_blocks=64, num_host_blocks=32, block_size=8)
    longest = max(len(p) for p in prompts) + MAX_NEW
    assert runner.max_model_len >= longest and (longest > TRAINED) == (PROMPT_LENS.get(name) is not SHORT)
    sched = ToyScheduler(runner, chunk=16, token_budget=40, max_running=4, preempt_every=5)
    for i, p in enumerate(prompts):
        sched.add(ToyRequest(f"r{i}", p, MAX_NEW, arrival_step=2 * i))
    sched.run()
    assert sched.stats.mixed_steps and sched.stats.swaps and sched.stats.recomputes
    outputs = {r.request_id: r.output for r in sched.finished}
    full = sum(assert_matches_hf(outputs[f"r{i}"], expected.tokens[i], expected.gaps[i], f"{name} r{i}")
               for i in range(len(prompts)))
    assert full >= len(prompts) - 1, f"{name}: only {full} of {len(prompts)} streams fully matched"
