"""Queue policies: fcfs, priority, score with aging (no starvation)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler_service.core.config import SchedulerConfig, SchedulingPolicy
from scheduler_service.core.policy import WaitingQueue, make_policy
from scheduler_service.core.request import Request, RequestStatus
from stepahead.plan import SamplingParams
from tests.unit.fake_executor import Driver, hashed_tokens

CONFIG = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4)


def req(rid, arrival, priority=0, prompt_len=4, max_tokens=4) -> Request:
    r = Request(rid, range(1, prompt_len + 1), SamplingParams(max_tokens=max_tokens), priority, arrival)
    r.queued_time = arrival  # what Scheduler.add_request sets
    return r


def drain(queue: WaitingQueue, now: float = 0.0) -> list[str]:
    out = []
    while (r := queue.pop(now)) is not None:
        out.append(r.request_id)
    return out


def queue_for(policy: SchedulingPolicy, **kw) -> WaitingQueue:
    return WaitingQueue(make_policy(replace(CONFIG, scheduling_policy=policy, **kw)))


def test_fcfs_is_arrival_order_and_removal_is_lazy():
    q = queue_for(SchedulingPolicy.FCFS)
    reqs = [req("c", 3.0), req("a", 1.0), req("b", 2.0, priority=-5)]
    for r in reqs:
        q.push(r)
    q.remove(reqs[1])
    assert len(q) == 2 and reqs[1] not in q
    assert drain(q) == ["b", "c"]


def test_priority_is_lower_value_first_then_arrival():
    q = queue_for(SchedulingPolicy.PRIORITY)
    for r in [req("late-high", 5.0, 0), req("low", 0.0, 3), req("early-high", 1.0, 0)]:
        q.push(r)
    assert drain(q) == ["early-high", "late-high", "low"]


def test_score_is_priority_first_then_length_and_wait():
    q = queue_for(SchedulingPolicy.SCORE, score_wait_weight=1.0, score_length_weight=0.5, max_wait_time=math.inf)
    q.push(req("long", 0.0, max_tokens=20))  # 0.5 * 24 = 12
    q.push(req("short-late", 5.0))  # 0.5 * 8 + 5 = 9
    q.push(req("better-longest-latest", 9.0, priority=-10, max_tokens=40))  # 0.5 * 44 + 9 = 31, but priority -10
    q.push(req("worse-oldest", -100.0, priority=1))  # 0.5 * 8 - 100 = -96, but priority 1
    assert drain(q, now=10.0) == ["better-longest-latest", "short-late", "long", "worse-oldest"]


def test_aged_requests_go_first_in_queueing_order():
    q = queue_for(SchedulingPolicy.SCORE, score_wait_weight=0.0, max_wait_time=10.0)
    q.push(req("bad-old", 0.0, priority=9))
    q.push(req("bad-older", -1.0, priority=8))
    q.push(req("good", 5.0, priority=0))
    assert q.peek(now=5.0).request_id == "good"
    assert drain(q, now=10.5) == ["bad-older", "bad-old", "good"]


def _starvation_run(max_wait: float) -> Request:
    """One slow, low-priority request against a stream of cheap, urgent ones."""
    clock = [0.0]
    config = replace(CONFIG, max_num_seqs=1, async_scheduling=False, scheduling_policy=SchedulingPolicy.SCORE,
                     score_wait_weight=0.0, max_wait_time=max_wait)
    d = Driver.create(config, hashed_tokens(1000), clock=lambda: clock[0])
    starving = req("starving", None, priority=5, max_tokens=2)
    d.scheduler.add_request(starving)
    for i in range(40):
        d.scheduler.add_request(req(f"urgent{i}", None, priority=0, max_tokens=2))
        d.tick()
        d.scheduler.check_integrity()
        clock[0] += 1.0
    return starving


def test_without_aging_the_score_policy_starves():
    assert _starvation_run(math.inf).first_scheduled_time is None


@pytest.mark.parametrize("max_wait", [3.0, 10.0])
def test_aging_bounds_the_wait(max_wait):
    starving = _starvation_run(max_wait)
    assert starving.first_scheduled_time is not None
    # Aged strictly after max_wait; the slot frees (or is preempted) at the next schedule.
    assert max_wait < starving.first_scheduled_time - starving.arrival_time <= max_wait + 1.0


def test_aged_request_preempts_running_work_that_has_not_aged():
    clock = [0.0]
    config = replace(CONFIG, max_num_seqs=1, async_scheduling=False, scheduling_policy=SchedulingPolicy.SCORE,
                     max_wait_time=2.0)
    d = Driver.create(config, hashed_tokens(1000), clock=lambda: clock[0])
    d.scheduler.add_request(req("hog", None, max_tokens=40))
    d.tick()
    clock[0] += 1.0
    d.scheduler.add_request(req("patient", None, priority=50, max_tokens=2))
    for _ in range(4):
        d.tick()
        clock[0] += 1.0
    patient = d.scheduler.get_request("patient")
    hog = d.scheduler.get_request("hog")
    assert hog.num_preemptions == 1 and hog.status is RequestStatus.PREEMPTED
    assert patient is None or patient.status is RequestStatus.RUNNING
    assert any(p.preempted_ids == ("hog",) for p in d.plans)


def test_score_policy_lets_better_priority_preempt_worse_running_work_once():
    clock = [0.0]
    config = replace(CONFIG, max_num_seqs=1, async_scheduling=False, scheduling_policy=SchedulingPolicy.SCORE,
                     max_wait_time=100.0)
    d = Driver.create(config, hashed_tokens(1000), clock=lambda: clock[0])
    d.scheduler.add_request(req("background", None, priority=2, max_tokens=30))
    d.tick()
    d.scheduler.add_request(req("urgent", None, priority=0, max_tokens=2))
    d.tick()
    background = d.scheduler.get_request("background")
    assert background.num_preemptions == 1, "priority 0 preempts running priority-2 work"
    for _ in range(4):  # urgent finishes, background resumes
        d.tick()
    assert d.scheduler.get_request("background").status is RequestStatus.RUNNING
    d.scheduler.add_request(req("urgent2", None, priority=0, max_tokens=2))
    d.tick()
    assert d.scheduler.get_request("background").num_preemptions == 1, "a victim is preempted by priority once"


def _score_driver(**kw) -> Driver:
    config = replace(CONFIG, max_num_seqs=2, async_scheduling=False, scheduling_policy=SchedulingPolicy.SCORE,
                     max_wait_time=100.0, **kw)
    return Driver.create(config, hashed_tokens(1000), clock=lambda: 0.0)


def _protected_worst_and_fresh(d: Driver) -> tuple[Request, Request]:
    """Two running priority-2 requests: `protected` (preempted once in its prefill, so it has
    no token to be readmitted first for, and the worst score: it is the tail of the running
    order) and `fresh` (never preempted, a better score). `d` prefills 4 tokens a request a
    step, so `protected`'s 30-token prompt leaves room for the priority-0 arrivals."""
    d.scheduler.add_request(req("protected", None, priority=2, prompt_len=30, max_tokens=20))
    d.tick()
    d.scheduler.add_request(req("short", None, priority=0, max_tokens=2))
    d.scheduler.add_request(req("urgent1", None, priority=0, max_tokens=2))
    d.tick()
    assert d.scheduler.get_request("protected").num_preemptions == 1
    d.scheduler.add_request(req("fresh", None, priority=2, max_tokens=20))
    for _ in range(8):  # short and urgent1 finish; protected and fresh run
        d.tick()
        d.scheduler.check_integrity()
    protected, fresh = d.scheduler.get_request("protected"), d.scheduler.get_request("fresh")
    assert protected.status is fresh.status is RequestStatus.RUNNING
    assert d.scheduler._running[-1] is protected, "the protected request is the worst running one"
    return protected, fresh


def test_score_policy_preempts_the_worst_request_it_may_not_only_the_worst_one():
    """A priority-0 arrival whose worst running request is protected (preempted once) takes
    the next worse-priority one instead of waiting for a slot (benchmarks/policies.py: at
    1.5x it waited up to 254 ms behind protected tails)."""
    d = _score_driver(max_num_batched_tokens=8, long_prefill_token_threshold=4)
    protected, fresh = _protected_worst_and_fresh(d)
    d.scheduler.add_request(req("urgent2", None, priority=0, max_tokens=2))
    d.tick()
    d.scheduler.check_integrity()
    assert protected.num_preemptions == 1 and protected.status is RequestStatus.RUNNING
    assert fresh.num_preemptions == 1 and fresh.status is RequestStatus.PREEMPTED
    assert d.scheduler.get_request("urgent2").status is RequestStatus.RUNNING


def test_score_policy_preempts_a_request_past_its_first_token_before_one_still_in_prefill():
    """Of the worst-priority running requests, a priority-0 arrival takes one that has
    streamed its first token, not the worse-scored one still in prefill (whose whole wait
    would go into its TTFT again: at 1.0x those missed the 2 s TTFT goodput target)."""
    d = _score_driver(max_num_batched_tokens=8)
    d.scheduler.add_request(req("decoding", None, priority=2, max_tokens=30))
    d.tick()
    d.tick()
    d.scheduler.add_request(req("prefilling", None, priority=2, prompt_len=40, max_tokens=2))
    d.tick()  # 7 of its 40 prompt tokens: no token yet
    decoding, prefilling = d.scheduler.get_request("decoding"), d.scheduler.get_request("prefilling")
    assert decoding.num_output_tokens > 0 and prefilling.num_output_tokens == 0
    assert d.scheduler._running[-1] is prefilling, "the request in prefill has the worse score"
    d.scheduler.add_request(req("urgent", None, priority=0, max_tokens=2))
    d.tick()
    d.scheduler.check_integrity()
    assert decoding.status is RequestStatus.PREEMPTED and decoding.num_preemptions == 1
    assert prefilling.status is RequestStatus.RUNNING and prefilling.num_preemptions == 0


def test_score_default_length_weight_bounds_how_long_a_long_request_is_passed_over():
    """Default weights: 1000 more remaining tokens are worth 5 s of waiting, so a long request
    goes ahead of a same-priority short one arriving 6 s after it (at 10 s per 1000 tokens,
    long priority-2 requests waited past the 2 s TTFT target at 1.0x load)."""
    q = queue_for(SchedulingPolicy.SCORE)
    q.push(req("long", 0.0, priority=2, max_tokens=1000))
    q.push(req("short-later", 6.0, priority=2))
    assert drain(q, now=6.0) == ["long", "short-later"]


def _long_and_short(**kw) -> WaitingQueue:
    """Default weights: a long priority-2 request (arrived at 0, ~1000 tokens: 5 s of length
    penalty) and a short one of the same priority arriving at 0.5 s, which goes first."""
    q = queue_for(SchedulingPolicy.SCORE, **kw)
    q.push(req("long", 0.0, priority=2, max_tokens=1000))
    q.push(req("short", 0.5, priority=2))
    return q


def test_score_ttft_target_serves_a_request_past_half_of_it_before_shorter_later_ones():
    """With `score_ttft_target` 2 s, the long request is urgent from 1 s of waiting until 2 s:
    its length no longer counts, so the later short one no longer passes it; past 2 s it
    cannot meet the target and its score orders it again (benchmarks/policies.py, seed 1 at
    1.0x: long priority-2 prompts passed over until they missed the 2 s target)."""
    q = _long_and_short(score_ttft_target=2.0)
    assert [q.peek(now).request_id for now in (0.9, 1.0, 1.9, 2.0)] == ["short", "long", "long", "short"]
    assert drain(_long_and_short(score_ttft_target=2.0), now=1.5) == ["long", "short"]
    without = _long_and_short()
    assert [without.peek(now).request_id for now in (0.9, 1.5, 2.0)] == ["short"] * 3


def test_an_urgent_request_still_goes_after_a_better_priority_and_after_aged_ones():
    q = _long_and_short(score_ttft_target=2.0, max_wait_time=10.0)
    q.push(req("better", 1.4, priority=1))
    q.push(req("aged", -9.0, priority=2, max_tokens=1000))
    assert drain(q, now=1.5) == ["aged", "better", "long", "short"]


def test_a_preempted_stream_is_readmitted_first_and_is_never_urgent():
    """A request preempted after its first token has met its TTFT (never urgent, never late)
    and its client waits mid-stream: it goes ahead of every request without a token, better
    priorities and urgent ones included, preempted streams in the order they were queued."""
    q = queue_for(SchedulingPolicy.SCORE, score_ttft_target=2.0)
    streams = []
    for rid, queued in (("resumed-later", 1.0), ("resumed", 0.5)):
        r = req(rid, 0.0, priority=2, max_tokens=1000)
        r.commit_token(5)
        r.queued_time = queued
        streams.append(r)
        q.push(r)
    q.push(req("short", 0.5, priority=2))
    q.push(req("better", 0.4, priority=0))
    q.push(req("urgent", -0.1, priority=0, max_tokens=1000))
    assert drain(q, now=1.5) == ["resumed", "resumed-later", "urgent", "better", "short"]
    assert not make_policy(replace(CONFIG, scheduling_policy=SchedulingPolicy.SCORE,
                                   score_ttft_target=2.0)).is_urgent(streams[1], 1.5)


def test_score_ttft_target_must_not_be_negative():
    with pytest.raises(ValueError, match="score_ttft_target"):
        replace(CONFIG, score_ttft_target=-1.0)
    with pytest.raises(ValueError, match="score_ttft_target"):
        replace(CONFIG, score_ttft_target=math.nan)


def test_scheduler_admits_the_urgent_long_request_when_a_slot_frees():
    """Through the scheduler core: one slot, held by a hog; when it frees at 1.5 s the long
    request (waiting 1.5 s of a 2 s target) is admitted before the shorter, later one."""
    clock = [0.0]
    config = replace(CONFIG, max_model_len=1100, num_gpu_blocks=600, max_num_seqs=1, async_scheduling=False,
                     scheduling_policy=SchedulingPolicy.SCORE, score_ttft_target=2.0)
    d = Driver.create(config, hashed_tokens(1000), clock=lambda: clock[0])
    d.scheduler.add_request(req("hog", None, max_tokens=3))
    d.tick()
    d.scheduler.add_request(req("long", None, priority=2, max_tokens=1000))
    clock[0] = 0.5
    d.scheduler.add_request(req("short", None, priority=2))
    clock[0] = 1.5
    for _ in range(6):  # the hog's last two tokens, then the next admission
        d.tick()
        d.scheduler.check_integrity()
    assert [r.request_id for p in d.plans for r in p.new_requests] == ["hog", "long"]


@given(ops=st.lists(st.tuples(st.sampled_from(["push", "push", "pop", "remove", "wait"]), st.integers(0, 2),
                              st.integers(1, 40), st.booleans(), st.sampled_from([0.25, 0.5, 1.5])),
                    max_size=60),
       ttft_target=st.sampled_from([0.0, 2.0]), max_wait=st.sampled_from([3.0, 30.0]))
def test_the_queue_head_is_the_score_policys_least_queue_key(ops, ttft_target, max_wait):
    """Oracle: whatever the heaps hold, `peek(now)` is a request with the least
    `queue_key(r, now)` (aged first, then urgent keys against scores). Times and weights are
    binary fractions, so equal keys are equal floats; 44 tokens weigh up to 11 s."""
    q = queue_for(SchedulingPolicy.SCORE, score_ttft_target=ttft_target, max_wait_time=max_wait,
                  score_length_weight=0.25)
    policy, now, live = q._policy, 0.0, []
    for i, (op, priority, length, streamed, dt) in enumerate(ops):
        if op == "push":
            r = req(f"r{i}", now - dt, priority=priority, max_tokens=length)
            if streamed:  # preempted after its first token; requeued now
                r.commit_token(5)
                r.queued_time = now
            q.push(r)
            live.append(r)
        elif op == "remove" and live:
            q.remove(live.pop(length % len(live)))
        elif op == "pop" and live:
            live.remove(q.pop(now))
        elif op == "wait":
            now += dt
        head = q.peek(now)
        assert (head is None) == (not live)
        if live:
            assert policy.queue_key(head, now) == min(policy.queue_key(r, now) for r in live)
