"""Greedy tokens from mixed batches (chunked prefill, joins, leaves) equal HF `generate`."""

from __future__ import annotations

import pytest

from testing.checkpoints import VARIANTS
from tests.model.driver import ToyRequest, ToyScheduler
from tests.model.oracle import MAX_NEW, check_against_hf, oracle_case
from worker_service.model_runner import ModelRunner

PROMPT_LENS = [1, 300, 7, 16, 17, 250, 31, 32, 33, 64, 2, 100, 128, 150, 200, 280]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _, prompts, expected = oracle_case(path, request.param, seed=0, prompt_seed=len(request.param), lens=PROMPT_LENS)
    return request.param, path, prompts, expected


def run_workload(runner, prompts, max_new: int = MAX_NEW, **driver_kwargs) -> ToyScheduler:
    sched = ToyScheduler(runner, **driver_kwargs)
    for i, p in enumerate(prompts):  # requests join over time
        sched.add(ToyRequest(f"r{i}", p, max_new, arrival_step=3 * (i // 2)))
    sched.run()
    return sched


def test_mixed_batches_match_hf_generate(checkpoint):
    name, path, prompts, expected = checkpoint
    runner = ModelRunner(path, num_blocks=420, block_size=16)
    assert runner.packed_linears > 0  # the default CPU layout: oneDNN-packed linears (the HF oracle's tie rule)
    sched = run_workload(runner, prompts, chunk=32, token_budget=96, max_running=12)
    # the workload really mixed prompt chunks with decodes, and requests left before others joined
    assert sched.stats.mixed_steps > 0 and sched.stats.placeholder_decodes > 0
    assert sched.stats.max_running_seen == 12
    full = check_against_hf(sched, prompts, expected)
    assert full >= len(prompts) - 2, f"{name}: only {full} streams fully matched"
    assert not runner.requests, "finished requests must be forgotten"
