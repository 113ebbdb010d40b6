"""Swap out/in and recompute preemption keep greedy outputs equal to HF `generate`."""

from __future__ import annotations

import pytest
import torch

from tests.model.driver import ToyRequest, ToyScheduler
from tests.model.oracle import MAX_NEW, check_against_hf, oracle_case
from worker_service.kv_cache import KVCache
from worker_service.model_config import ModelConfig
from worker_service.model_runner import ModelRunner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("preempt")
    _, prompts, expected = oracle_case(path, "qwen3_tied_gqa1", seed=3, prompt_seed=11,
                                       lens=[3, 40, 90, 17, 64, 120, 5, 33])
    return path, prompts, expected


def test_swap_and_recompute_preemption_continue_identically(checkpoint):
    path, prompts, expected = checkpoint
    runner = ModelRunner(path, num_blocks=100, num_host_blocks=100, block_size=8)
    sched = ToyScheduler(runner, chunk=16, token_budget=48, max_running=6, preempt_every=4)
    for i, p in enumerate(prompts):
        sched.add(ToyRequest(f"r{i}", p, MAX_NEW, arrival_step=i))
    sched.run()
    assert sched.stats.swaps >= 5 and sched.stats.recomputes >= 5
    assert check_against_hf(sched, prompts, expected) >= len(prompts) - 1
    assert sorted(sched.free_host_blocks) == list(range(100)) and not runner.requests


def test_kv_swap_round_trip_moves_every_layer(checkpoint):
    path, _, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    cache = KVCache(cfg, num_blocks=6, num_host_blocks=4, block_size=4, dtype=torch.float32,
                    device=torch.device("cpu"))
    cache.device_pool.normal_()
    before = cache.device_pool[:, :, [1, 4]].clone()  # [layers, 2, 2, block, kvh, d]
    cache.swap_out(((1, 3), (4, 0)))
    cache.device_pool.zero_()
    cache.swap_in(((3, 5), (0, 2)))
    torch.testing.assert_close(cache.device_pool[:, :, [5, 2]], before, rtol=0, atol=0)
    assert cache.device_pool[:, :, [0, 1, 3, 4]].abs().sum() == 0
    with pytest.raises(ValueError, match="swap_in: source block out of range"):
        cache.swap_in(((4, 0),))
