"""The CUDA-path properties that also hold (and can be checked) on CPU.

- a plan may not read a token slot reserved for a step still in flight (issue 15, finding 6);
- step inputs are views of one persistent arena per buffer slot: contiguous, at addresses
  that repeat every other step (finding 3, CUDA-graph readiness);
- launching further ahead than the double buffers reach still yields every step's own ids;
- bucketed decode padding with the dummy KV block and the paged decode backend keep greedy
  outputs equal to Hugging Face's;
- the profiling run (KV sizing, finding 8) writes only the dummy block and leaves no state.
"""

from __future__ import annotations

import pytest
import torch

from stepahead.plan import NewRequest, RunningRequest, StepPlan
from tests.model.driver import GREEDY, ToyRequest, ToyScheduler
from tests.model.oracle import MAX_NEW, check_against_hf, oracle_case
from worker_service.input_batch import decode_bucket
from worker_service.memory_profile import profile_run, split_memory
from worker_service.model_runner import ModelRunner
from worker_service.paged_attention import PagedDecodeBackend
from worker_service.plan_checks import PlanError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("readiness")
    _, prompts, expected = oracle_case(path, "llama_tied_gqa4", seed=7, prompt_seed=21, lens=[5, 40, 17, 3, 33, 64, 9])
    return path, prompts, expected


def _prefill(prompts: list[list[int]], blocks_each: int = 8) -> StepPlan:
    return StepPlan(0, new_requests=tuple(
        NewRequest(f"r{i}", tuple(p), GREEDY, tuple(range(blocks_each * i, blocks_each * (i + 1))), 0, len(p))
        for i, p in enumerate(prompts)))


def _decodes(step: int, n: int, placeholder: bool) -> StepPlan:
    return StepPlan(step, running=tuple(RunningRequest(f"r{i}", (), 1, placeholder) for i in range(n)))


def test_a_slot_sampled_by_an_inflight_step_is_not_a_known_input(checkpoint):
    path, prompts, _ = checkpoint
    runner = ModelRunner(path, num_blocks=64, block_size=8)
    first = runner.launch(_prefill(prompts[:2]))  # not waited: r0/r1's sampled slots are reserved (-1)
    with pytest.raises(PlanError, match="'r0'.*still in flight"):
        runner.launch(_decodes(1, 2, placeholder=False))
    first.wait()
    assert runner.execute(_decodes(1, 2, placeholder=False)).sampled_token_ids.keys() == {"r0", "r1"}


def test_a_placeholder_must_read_the_token_sampled_last(checkpoint):
    path, prompts, _ = checkpoint
    runner = ModelRunner(path, num_blocks=64, block_size=8)
    plan = StepPlan(0, new_requests=(NewRequest("r0", tuple(prompts[1]), GREEDY, tuple(range(8)), 0, 8),))
    runner.execute(plan)  # a partial prefill: nothing sampled, r0 is not in the previous step's rows
    with pytest.raises(PlanError, match="placeholder"):
        runner.launch(StepPlan(1, running=(RunningRequest("r0", (), 1, True),)))


def test_out_of_vocabulary_prompt_is_a_plan_error(checkpoint):
    path, _, _ = checkpoint
    runner = ModelRunner(path, num_blocks=8, block_size=8)
    with pytest.raises(PlanError, match="'bad'.*vocabulary"):
        runner.launch(StepPlan(0, new_requests=(NewRequest("bad", (1, runner.vocab_size), GREEDY, (0,), 0, 2),)))
    assert not runner.requests


def test_step_inputs_are_contiguous_views_of_a_persistent_arena(checkpoint):
    path, prompts, _ = checkpoint
    runner = ModelRunner(path, num_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=256)
    seen = []
    orig = runner._forward

    def spy(inputs, arena=None):
        seen.append(inputs)
        return orig(inputs, arena)

    runner._forward = spy
    runner.execute(_prefill(prompts[:3]))
    for t in range(1, 5):
        runner.execute(_decodes(t, 3, placeholder=False))
    for step, inputs in enumerate(seen):
        arena = runner.buffers[step % 2].dev
        lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel() * arena.element_size()
        for name, t in [("block_tables", inputs.meta.block_tables), ("prefill_index", inputs.meta.prefill_token_index),
                        ("input_ids", inputs.input_ids), ("seq_lens", inputs.meta.seq_lens),
                        ("slots", inputs.meta.slot_mapping)]:
            assert t.is_contiguous(), f"step {step}: {name} is not contiguous"
            assert t.numel() == 0 or lo <= t.data_ptr() < hi, f"step {step}: {name} is not in the slot's arena"
    # fixed offsets: the same input lives at the same address every other step
    assert seen[1].input_ids.data_ptr() == seen[3].input_ids.data_ptr() != seen[2].input_ids.data_ptr()
    assert seen[1].meta.block_tables.data_ptr() == seen[3].meta.block_tables.data_ptr()


def test_launching_far_ahead_still_reports_each_steps_own_ids(checkpoint):
    """Five steps launched before any is waited: the host-id buffers are double, so the
    runner must make step t-2 read its ids before step t reuses its buffer."""
    path, prompts, _ = checkpoint
    plans = [_prefill(prompts[:3])] + [_decodes(t, 3, placeholder=True) for t in range(1, 5)]
    seq = ModelRunner(path, num_blocks=64, block_size=8)
    want = [seq.execute(p).sampled_token_ids for p in plans]
    ahead = ModelRunner(path, num_blocks=64, block_size=8)
    pending = [ahead.launch(p) for p in plans]
    assert [p.wait().sampled_token_ids for p in pending] == want


def test_decode_buckets():
    assert [decode_bucket(n, 256) for n in (1, 2, 3, 5, 8, 9, 17, 250)] == [1, 2, 4, 8, 8, 16, 24, 256]
    assert decode_bucket(7, 6) == 7  # never below the batch itself


@pytest.mark.parametrize("backend", ["torch", "paged"])
def test_padded_decode_batches_match_hf(checkpoint, backend):
    path, prompts, expected = checkpoint
    runner = ModelRunner(path, num_blocks=200, block_size=8, pad_decode_batches=True,
                         attention_backend=PagedDecodeBackend() if backend == "paged" else None)
    padded = []
    orig = runner._forward
    runner._forward = lambda inputs, arena=None: (padded.append(inputs.num_padding), orig(inputs, arena))[1]
    sched = ToyScheduler(runner, chunk=16, token_budget=48, max_running=5)
    for i, p in enumerate(prompts):
        sched.add(ToyRequest(f"r{i}", p, MAX_NEW, arrival_step=2 * i))
    sched.run()
    assert max(padded) > 0, "no decode-only step was padded"
    assert check_against_hf(sched, prompts, expected) >= len(prompts) - 1
    assert not runner.requests


def test_profile_run_touches_only_the_dummy_block(checkpoint):
    path, prompts, _ = checkpoint
    runner = ModelRunner(path, num_blocks=32, block_size=8, max_num_seqs=4, max_num_batched_tokens=96,
                         max_model_len=64, pad_decode_batches=True)
    runner.kv_cache.device_pool.normal_()
    before = runner.kv_cache.device_pool[:, :, : runner.num_blocks].clone()
    profile_run(runner)
    assert torch.equal(runner.kv_cache.device_pool[:, :, : runner.num_blocks], before)
    assert not runner.requests and runner.last_logits is None
    assert (runner.table.num_blocks == 0).all()


def test_memory_split_leaves_the_rest_to_the_kv_cache():
    gib = 1 << 30
    split = split_memory(total=80 * gib, utilization=0.9, weights=16 * gib, peak_allocated=20 * gib,
                         non_torch=gib)
    assert split.budget == int(72 * gib) and split.step_peak == 4 * gib
    assert split.kv_cache == int(72 * gib) - 20 * gib - gib
    with pytest.raises(ValueError, match="no device memory left for the KV cache"):
        split_memory(total=10 * gib, utilization=0.5, weights=4 * gib, peak_allocated=5 * gib, non_torch=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        split_memory(total=gib, utilization=1.5, weights=0, peak_allocated=0, non_torch=0)


def test_attention_backend_flag_builds_the_paged_backend(checkpoint, monkeypatch):
    import argparse

    from stepahead import config as cfg
    from worker_service.daemon import WorkerConfig, add_arguments
    from worker_service.runners import build_runner

    path, _, _ = checkpoint
    parser = argparse.ArgumentParser()
    monkeypatch.setenv("STEPAHEAD_MAX_NUM_SEQS", "8")
    add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--attention-backend", "paged", "--num-gpu-blocks-override", "16"])
    runner, _ = build_runner(cfg.from_args(WorkerConfig, args))
    assert isinstance(runner.backend, PagedDecodeBackend) and runner.backend.kernel == "torch"
    assert runner.max_num_seqs == 8 and runner.buffers[0].max_reqs == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flashy"])


def _splitmix64_reference(x: int) -> int:
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def test_vectorised_seeded_uniforms_equal_python_splitmix64():
    """The host packs seeded uniforms with numpy uint64 arithmetic (one pass per step); they
    must be bit-identical to SplitMix64 in Python integers, for any seed a client can send."""
    import random

    from worker_service.sampler import seeded_uniforms

    rng = random.Random(3)
    seeds = [0, 1, -1, 2**63, 2**64 - 1, -(2**63)] + [rng.randrange(-(10**30), 10**30) for _ in range(500)]
    counts = [rng.randrange(0, 1 << 40) for _ in seeds]
    mask = (1 << 64) - 1
    want = [((_splitmix64_reference(_splitmix64_reference(s & mask) ^ (n & mask)) >> 11) + 1) * 2.0**-53
            for s, n in zip(seeds, counts)]
    assert seeded_uniforms(seeds, counts).tolist() == want
