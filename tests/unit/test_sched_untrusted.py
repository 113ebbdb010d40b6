"""The scheduler core and what it receives over the network: every submission is checked
against the shared limits again (whatever a gateway did), the waiting queue is bounded, a
worker's result is checked before anything is committed, and a request the worker failed
alone ends with ERROR and the worker's reason while the others run on."""

from __future__ import annotations

import dataclasses
import math

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import FinishReason, QueueFull, Request, RequestRejected
from scheduler_service.core.scheduler import Scheduler
from stepahead.plan import SamplingParams, StepResult
from tests.unit.fake_executor import Driver, RequestSpec, hashed_tokens, run_alone

VOCAB = 1000
TOKENS = hashed_tokens(vocab_size=VOCAB)
CONFIG = SchedulerConfig(num_gpu_blocks=32, max_model_len=64, block_size=4, eos_token_ids=(0,), vocab_size=VOCAB)


def greedy(max_tokens: int = 4, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("sampling, field", [
    (SamplingParams(temperature=math.nan), "sampling.temperature"),
    (SamplingParams(top_k=-7), "sampling.top_k"),
    (SamplingParams(top_p=0.0), "sampling.top_p"),
    (SamplingParams(min_p=math.inf), "sampling.min_p"),
    (SamplingParams(stop_token_ids=(VOCAB,)), "sampling.stop_token_ids"),
])
def test_every_submission_is_checked_again(sampling, field):
    sched = Scheduler(CONFIG)
    with pytest.raises(RequestRejected, match=field):
        sched.add_request(Request("a", [1, 2], sampling))
    with pytest.raises(RequestRejected, match="prompt.token_ids"):
        sched.add_request(Request("b", [1, 10**6], greedy()))
    with pytest.raises(RequestRejected, match="priority"):
        sched.add_request(Request("c", [1], greedy(), priority=5000))
    assert not sched.has_unfinished_requests()


def test_vanishing_floats_are_normalised_before_planning():
    sched = Scheduler(CONFIG)
    sched.add_request(Request("a", [1, 2], SamplingParams(temperature=0.7, top_p=1e-46)))
    [new] = sched.schedule().new_requests
    assert new.sampling.top_p > 0 and new.sampling.temperature == 0.7


def test_waiting_queue_bound():
    sched = Scheduler(dataclasses.replace(CONFIG, max_queued_requests=2))
    sched.add_request(Request("a", [1], greedy()))
    sched.add_request(Request("b", [1], greedy()))
    with pytest.raises(QueueFull, match="max-queued-requests"):
        sched.add_request(Request("c", [1], greedy()))
    assert sched.schedule() is not None  # both admitted: room in the queue again
    sched.add_request(Request("c", [1], greedy()))


FORGED = {
    "token outside the vocabulary": lambda plan: StepResult(plan.step_id, {"a": VOCAB, "b": 1}),
    "token for a request it did not sample": lambda plan: StepResult(plan.step_id, {"a": 1, "b": 1, "z": 1}),
    "token missing": lambda plan: StepResult(plan.step_id, {"a": 1}),
    "failure of an unknown request": lambda plan: StepResult(plan.step_id, {"a": 1, "b": 1}, failed={"z": "x"}),
    "token and failure at once": lambda plan: StepResult(plan.step_id, {"a": 1, "b": 1}, failed={"a": "x"}),
    "wrong step": lambda plan: StepResult(plan.step_id + 1, {"a": 1, "b": 1}),
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_result_that_does_not_fit_its_plan_changes_nothing(forgery):
    sched = Scheduler(CONFIG)
    sched.add_request(Request("a", [1, 2], greedy()))
    sched.add_request(Request("b", [3], greedy()))
    plan = sched.schedule()
    before = sched.stats()
    with pytest.raises(ValueError):
        sched.update_from_output(plan, FORGED[forgery](plan))
    assert sched.stats() == before and sched.num_in_flight() == 1
    sched.check_integrity()
    events = sched.update_from_output(plan, StepResult(plan.step_id, {"a": 1, "b": 1}))  # the honest one
    assert {e.request_id for e in events} == {"a", "b"}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_failed_by_the_worker_ends_alone(async_scheduling):
    """'bad' fails on the worker in its first step; with async scheduling its next decode is
    already in flight and must be dropped as stale. The others are untouched."""
    config = dataclasses.replace(CONFIG, async_scheduling=async_scheduling)
    d = Driver.create(config, TOKENS)
    specs = [RequestSpec(rid, (5, i + 1), greedy(6)) for i, rid in enumerate(["x", "bad", "y"])]
    for spec in specs:
        d.scheduler.add_request(spec.build())
    while d.step():
        pass
    result = d.results.popleft()
    d.executor.mark_reported(result.step_id)
    tokens = dict(result.sampled_token_ids)
    del tokens["bad"]
    _, events = d.loop.commit(dataclasses.replace(result, sampled_token_ids=tokens,
                                                  failed={"bad": "invalid sampling row"}))
    for event in events:
        d.record(event)
    [failed] = [e for e in events if e.request_id == "bad"]
    assert failed.finish_reason is FinishReason.ERROR and "invalid sampling row" in failed.message
    d.run_until_done()
    for spec in specs:
        if spec.request_id != "bad":
            assert d.outputs[spec.request_id] == run_alone(config, spec, TOKENS)[0]
    assert d.finished["bad"] is FinishReason.ERROR and d.outputs.get("bad", []) == []
    stats = d.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
