"""More than two plans in flight (`--max-concurrent-batches 3`): a placeholder input is always
the token the previous plan sampled (the worker's rule, checked by the fake executor), and
every request ends with the tokens it gets alone through the synchronous loop.

The failure this guards against: a decode left out of plan t+1 (its new block waited for a
fence, or the budget ran out) while its token of plan t was still unreported was planned in
t+2 with a placeholder input from t, which the worker refuses (it keeps only the previous
step's sampled ids)."""

from __future__ import annotations

import random

import pytest

from scheduler_service.core.config import SchedulerConfig
from stepahead.plan import SamplingParams
from tests.unit.fake_executor import Driver, RequestSpec, hashed_tokens, run_alone

TOKENS = hashed_tokens(12)


def workload(seed: int) -> tuple[SchedulerConfig, list[RequestSpec]]:
    rng = random.Random(seed)
    config = SchedulerConfig(
        block_size=2, num_gpu_blocks=rng.choice([10, 12, 16]), max_model_len=20,
        max_num_seqs=rng.choice([2, 3, 8]), max_num_batched_tokens=rng.choice([3, 8]),
        async_scheduling=True, max_concurrent_batches=3, eos_token_ids=(0,),
    )
    specs = [RequestSpec(f"r{i}", tuple(rng.randint(1, 11) for _ in range(rng.randint(1, 8))),
                         SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True))
             for i in range(rng.randint(2, 6))]
    return config, specs


@pytest.mark.parametrize("seed_block", range(4))
def test_three_plans_in_flight_read_only_the_previous_steps_placeholders(seed_block):
    # 15 of seeds 0..299 failed before the fix (the first ones: 11, 65); 40 seeds per block
    num_plans = 0
    for seed in range(seed_block * 40, seed_block * 40 + 40):
        config, specs = workload(seed)
        driver = Driver.create(config, TOKENS)
        for spec in specs:
            driver.scheduler.add_request(spec.build())
        driver.run_until_done(max_ticks=2000)
        num_plans += len(driver.plans)
        for spec in specs:
            want, reason = run_alone(config, spec, TOKENS)
            assert (driver.outputs.get(spec.request_id, []), driver.finished[spec.request_id]) == (want, reason), \
                (seed, spec.request_id)
    assert num_plans > 200, "the workloads were meant to keep the window full"
