"""The preemption rule (`scheduler_service/core/preemption.py`) and expected-wait admission
control (`admission.ExpectedWait`)."""

from __future__ import annotations

import pytest

from scheduler_service.core.admission import ExpectedWait
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.preemption import PreemptionRule
from scheduler_service.core.request import QueueFull, Request
from stepahead.plan import SamplingParams

CONFIG = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=8)


def req(rid: str, max_tokens: int = 10) -> Request:
    return Request(rid, range(1, 5), SamplingParams(max_tokens=max_tokens), 2, 0.0)


def test_a_preempted_request_is_protected_until_it_made_progress():
    rule = PreemptionRule(CONFIG)
    r = req("r")
    assert not rule.protected(r)
    r.num_preemptions, r.output_at_preemption = 1, 0
    for _ in range(CONFIG.preemption_min_progress - 1):
        r.output_token_ids.append(5)
    assert rule.protected(r)
    r.output_token_ids.append(5)
    assert not rule.protected(r)
    assert not PreemptionRule(SchedulerConfig(num_gpu_blocks=64, max_model_len=64, preemption_min_progress=0)
                              ).protected(req("fresh"))


def test_a_policy_preemption_only_when_it_pays():
    rule = PreemptionRule(CONFIG)
    cheap, costly = req("cheap"), req("costly")
    cheap.num_computed_tokens, costly.num_computed_tokens = 4, 40  # 0.5 and 5 steps of an 8-token budget
    assert rule.policy_victims([cheap, costly], gain=3) == [cheap]
    assert rule.policy_victims([cheap, costly], gain=0) == []


def test_expected_wait_sheds_past_the_bound_after_measuring_a_backlogged_rate():
    gate = ExpectedWait(2.0)
    gate.check(req("first"), ahead=100, now=0.0)  # nothing measured yet: admitted
    gate.admitted(0.0, num_waiting=5)
    gate.admitted(0.5, num_waiting=5)  # one backlogged gap of 0.5 s: 2 admissions/s
    gate.check(req("ok"), ahead=3, now=0.5)  # 1.5 s
    with pytest.raises(QueueFull, match="max-expected-wait"):
        gate.check(req("shed"), ahead=5, now=0.5)  # 2.5 s
    ExpectedWait(None).check(req("off"), ahead=10**6, now=0.0)  # off: never refuses


def _overloaded(max_expected_wait: float | None):
    """One sequence slot held by a long priority-0 request; a priority-2 request waiting
    behind it, and later a priority-2 stream preempted after its first token; score policy,
    aging bound 2 s."""
    from dataclasses import replace

    from scheduler_service.core.config import SchedulingPolicy
    from tests.unit.fake_executor import Driver, hashed_tokens

    clock = [0.0]
    config = replace(CONFIG, max_num_seqs=1, async_scheduling=False, scheduling_policy=SchedulingPolicy.SCORE,
                     max_wait_time=2.0, max_expected_wait=max_expected_wait)
    d = Driver.create(config, hashed_tokens(1000), clock=lambda: clock[0])
    d.scheduler.add_request(Request("hog", range(1, 5), SamplingParams(max_tokens=40), 0, None))
    d.tick()
    d.scheduler.add_request(Request("starved", range(1, 5), SamplingParams(max_tokens=2), 2, None))
    return d, clock


def test_admission_control_sheds_a_request_not_admitted_within_the_aging_bound():
    """With admission control on, the starved request is refused (QueueFull, retry later) as
    soon as it has waited past the bound, and is gone from the core; it never ages into an
    admission. Off, it ages and preempts the hog as before."""
    d, clock = _overloaded(max_expected_wait=5.0)
    waits = []
    while d.scheduler.get_request("starved") is not None:
        clock[0] += 0.25
        d.tick()
        d.scheduler.check_integrity()
        waits.append(clock[0])
    shed = d.scheduler.take_shed()
    assert [rid for rid, _ in shed] == ["starved"] and isinstance(shed[0][1], QueueFull)
    assert "retry later" in str(shed[0][1]) and waits[-1] - 2.0 <= 0.25, "shed at the first step past the bound"
    assert d.scheduler.get_request("hog").num_preemptions == 0 and d.scheduler.take_shed() == []
    assert d.scheduler.stats().num_waiting == 0

    d, clock = _overloaded(max_expected_wait=None)
    for _ in range(12):
        clock[0] += 0.25
        d.tick()
    assert d.scheduler.take_shed() == [] and d.scheduler.get_request("hog").num_preemptions == 1


def test_a_preempted_stream_is_never_shed():
    """A request that has streamed a token cannot be refused any more: past the bound it ages
    (goes first) instead."""
    gate = ExpectedWait(1.0, max_wait=2.0)
    stream, fresh = req("stream"), req("fresh")
    for r in (stream, fresh):
        r.queued_time = 0.0
    stream.output_token_ids.append(5)
    assert gate.overdue(fresh, 2.0) is None and gate.overdue(stream, 2.5) is None
    assert isinstance(gate.overdue(fresh, 2.5), QueueFull)
    assert ExpectedWait(None, max_wait=2.0).overdue(fresh, 9.0) is None
