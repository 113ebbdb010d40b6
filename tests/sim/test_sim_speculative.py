"""The sim worker speculates with a configurable acceptance rate: under the real scheduler
core, async and sync, with preemption, every request still gets the reference tokens, the
measured acceptance follows the configured rate, and fewer steps are needed."""

from __future__ import annotations

import pytest

from scheduler_service.core.config import PreemptionMode, SchedulerConfig
from scheduler_service.core.request import Request
from stepahead.speculative import SpeculativeConfig
from tests.integration.local_engine import LocalEngine
from tests.sim.workload import mixed_workload
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner
from worker_service.sim.tokens import reference_output

BLOCK = 16


def run(model_dir, profile, k: int, rate: float, async_on: bool, num_blocks: int = 60):
    sim = SimRunner(model_dir, load_profile(str(profile)), num_blocks=num_blocks, block_size=BLOCK,
                    eos_probability=0.05, seed=11, speculative_config=SpeculativeConfig(k) if k else None,
                    acceptance_rate=rate)
    config = SchedulerConfig(num_gpu_blocks=sim.num_blocks, num_cpu_blocks=sim.num_host_blocks,
                             max_model_len=sim.max_model_len, block_size=BLOCK, max_num_batched_tokens=512,
                             async_scheduling=async_on, eos_token_ids=sim.eos_token_ids, num_speculative_tokens=k,
                             preemption_mode=PreemptionMode.SWAP)
    e = LocalEngine(sim, config)
    work = mixed_workload(32, sim.vocab_size)
    for i, (prompt, sampling) in enumerate(work):
        e.add(Request(f"r{i}", prompt, sampling))
    e.run()
    e.assert_no_leaks()
    return sim, e, work


@pytest.mark.parametrize("async_on", [True, False])
def test_speculation_keeps_the_reference_tokens(sim_model_dir, fast_profile, async_on):
    _, plain, _ = run(sim_model_dir, fast_profile, 0, 0.0, async_on)
    sim, e, work = run(sim_model_dir, fast_profile, 4, 0.7, async_on)
    for i, (prompt, sampling) in enumerate(work):
        assert e.outputs[f"r{i}"] == reference_output(sim.rule, prompt, sampling, sim.max_model_len), f"r{i}"
    counts = e.scheduler.counters()
    assert e.scheduler.stats().num_preemptions > 0
    rate = counts["spec_num_accepted_tokens"] / counts["spec_num_draft_tokens"]
    # a draft is tried only after the one before it was accepted: per-draft rate 0.7 gives an
    # accepted share of (0.7 + 0.49 + 0.343 + 0.24) / 4 = 0.44 of K = 4 drafts
    assert 0.35 < rate < 0.55, rate
    assert counts["num_steps"] < plain.scheduler.counters()["num_steps"]
