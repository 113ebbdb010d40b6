"""The bulk decode path (`scheduler_service/core/decodes.py`) against its oracle, the per-request
rules (`PerRequestScheduler`: each decode decided by `token_rules.num_new_tokens`
and committed by `commit_one`, the prefix-cache check and `add_committed`, one by one): the
same workload driven in lockstep through both cores gives the same plans (the same
requests, tokens, blocks and orders to the worker; only the order of running deltas may
differ), the same events (a plain token where the rules make one), the same block
accounting after every step, and the same outputs."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.events import PlainTokenEvent
from tests.unit.fake_executor import Driver, RequestSpec, hashed_tokens
from tests.unit.per_request_scheduler import PerRequestScheduler
from tests.unit.test_sched_stateful import EOS, configs, request_params

TOKENS = hashed_tokens(vocab_size=12)  # EOS (0) about once in 12 tokens


def plan_view(plan) -> tuple:
    return (plan.step_id, plan.new_requests, tuple(sorted(plan.running)), tuple(sorted(plan.finished_ids)),
            tuple(sorted(plan.preempted_ids)), plan.swap_out, plan.swap_in)


def event_view(events) -> set:
    return {(type(e).__name__, e.request_id, tuple(e.new_token_ids), e.finish_reason, e.queue_time is not None,
             e.message) for e in events}


def counts(driver: Driver) -> tuple:
    s = driver.scheduler.stats()
    return (s.num_running, s.num_waiting, s.num_swapped, s.num_free_blocks, s.num_fenced_blocks, s.num_cached_blocks,
            s.num_used_host_blocks, s.num_preemptions)


def lockstep(config, specs: list[tuple[int, RequestSpec]], aborts: dict[int, str], seed: int) -> Driver:
    """Drive a bulk core and a per-request core through the same workload; assert they agree
    after every step. Returns the bulk one."""
    bulk = Driver.create(config, TOKENS)
    alone = Driver.create(config, TOKENS, scheduler_class=PerRequestScheduler)
    rng, tick, pending = random.Random(seed), 0, list(specs)
    while pending or bulk.scheduler.has_unfinished_requests() or bulk.results:
        assert tick < 2000, "not done"
        for d in (bulk, alone):
            for at, spec in pending:
                if at == tick:
                    d.scheduler.add_request(spec.build(arrival_time=float(at)))
            if tick in aborts:
                d.abort(aborts[tick])
        pending = [(at, spec) for at, spec in pending if at > tick]
        plans = [d.step() for d in (bulk, alone)]
        while plans[0] and rng.random() < 0.6:  # sometimes fill the window, sometimes commit at once
            plans = [d.step() for d in (bulk, alone)]
        assert plans[0] == plans[1], (tick, plans)
        for mine, theirs in zip(bulk.plans, alone.plans):
            assert plan_view(mine) == plan_view(theirs), (tick, mine, theirs)
        if bulk.results:
            got, want = bulk.deliver(), alone.deliver()
            assert event_view(got) == event_view(want), (tick, got, want)
        for d in (bulk, alone):
            d.scheduler.check_integrity()
        assert counts(bulk) == counts(alone), tick
        tick += 1
    assert bulk.outputs == alone.outputs and bulk.finished == alone.finished
    return bulk


@settings(max_examples=80, deadline=None)
@given(configs(), st.lists(st.tuples(st.integers(0, 12), request_params()), min_size=1, max_size=10),
       st.data())
def test_bulk_decodes_equal_the_per_request_rules(config, arrivals, data):
    # a speculating decode is always decided alone; nobody here reports prepared grammars (the
    # state machine does), so structured requests queue at once
    config = dataclasses.replace(config, num_speculative_tokens=0, prepare_grammars=False)
    specs = [(at, RequestSpec(f"r{i}", prompt, sampling, priority, salt))
             for i, (at, (prompt, sampling, priority, salt)) in enumerate(arrivals)]
    aborts = {data.draw(st.integers(0, 30)): f"r{i}" for i in data.draw(st.sets(st.integers(0, len(specs) - 1),
                                                                                 max_size=2))}
    lockstep(config, specs, aborts, data.draw(st.integers(0, 2**16)))


def test_a_long_decode_run_goes_plain_in_bulk_with_new_blocks_and_prefix_hits():
    """Many running requests decoding past several block boundaries with prefix caching: the
    bulk path gives out blocks and registers filled ones exactly as the rules do."""
    from scheduler_service.core.config import SchedulerConfig
    from stepahead.plan import SamplingParams

    config = SchedulerConfig(num_gpu_blocks=400, max_model_len=96, block_size=4, max_num_batched_tokens=64,
                             max_num_seqs=32, eos_token_ids=(EOS,), max_concurrent_batches=3)
    shared = tuple(range(1, 13))
    specs = [(i // 8, RequestSpec(f"r{i}", shared + (20 + i,), SamplingParams(temperature=0.0, max_tokens=40,
                                                                                ignore_eos=i % 3 == 0)))
             for i in range(24)]
    bulk = lockstep(config, specs, {}, seed=7)
    plain = [e for e in bulk.events if type(e) is PlainTokenEvent]
    assert len(plain) > 200, "the run must be mostly plain decodes"
    assert bulk.scheduler.stats().prefix_hit_tokens > 0
