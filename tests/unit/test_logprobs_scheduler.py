"""Logprobs on the scheduler: a worker's logprobs are checked like its tokens, prompt
logprobs are forwarded once per position, and the wire format round-trips."""

from __future__ import annotations

import math

import pytest

from scheduler_service.core.logprob_events import take_prompt_logprobs
from scheduler_service.core.result_checks import check_logprobs
from scheduler_service.core.request import Request
from stepahead import codec, limits
from stepahead.logprobs import Logprobs, PromptLogprobs
from stepahead.plan import SamplingParams, SpecOutcome, StepResult

ASKS = SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=1)


def result(**kw) -> StepResult:
    return StepResult(1, sampled_token_ids={"a": 5}, **kw)


@pytest.mark.parametrize("bad, why", [
    (dict(logprobs={"a": Logprobs(6, -1.0)}), "not of its sampled token"),
    (dict(logprobs={"b": Logprobs(5, -1.0)}), "not of its sampled token"),
    (dict(logprobs={"a": Logprobs(5, math.nan)}), "malformed"),
    (dict(logprobs={"a": Logprobs(5, 0.5)}), "malformed"),
    (dict(logprobs={"a": Logprobs(5, -1.0, ((1, -1.0),) * 3)}), "malformed"),
    (dict(logprobs={"a": Logprobs(5, -1.0, ((999, -1.0),))}), "vocabulary"),
    (dict(prompt_logprobs={"z": PromptLogprobs(1, ())}), "did not run"),
    (dict(prompt_logprobs={"a": PromptLogprobs(0, (Logprobs(1, -1.0),))}), "position 0"),
    # speculative decoding: one entry per accepted draft, of that draft, with the sampled token's
    (dict(logprobs={"a": Logprobs(5, -1.0)}, speculation={"a": SpecOutcome(2, (3, 4), (Logprobs(3, -1.0),))}),
     "accepted drafts"),
    (dict(logprobs={"a": Logprobs(5, -1.0)}, speculation={"a": SpecOutcome(1, (3,), (Logprobs(4, -1.0),))}),
     "accepted drafts"),
    (dict(speculation={"a": SpecOutcome(1, (3,), (Logprobs(3, -1.0),))}), "accepted drafts"),
    (dict(logprobs={"a": Logprobs(5, -1.0)}, speculation={"a": SpecOutcome(1, (3,), (Logprobs(3, 0.5),))}),
     "malformed"),
])
def test_forged_logprobs_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        check_logprobs(result(**bad), {"a": 5}, {"a"}, vocab_size=100, max_logprobs=2)
    check_logprobs(result(logprobs={"a": Logprobs(5, -math.inf, ((1, -0.5), (5, -math.inf)))}),
                          {"a": 5}, {"a"}, vocab_size=100, max_logprobs=2)


def test_prompt_positions_go_out_once_and_the_request_stops_asking():
    req = Request("a", [1, 2, 3, 4, 5], ASKS)
    assert req.needs_prompt_logprobs
    chunk = PromptLogprobs(1, tuple(Logprobs(t, -1.0) for t in (2, 3)))
    assert take_prompt_logprobs(req, StepResult(1, prompt_logprobs={"a": chunk})) == chunk
    assert take_prompt_logprobs(req, StepResult(2, prompt_logprobs={"a": chunk})) is None  # recomputed: not again
    overlap = PromptLogprobs(1, tuple(Logprobs(t, -1.0) for t in (2, 3, 4, 5)))
    assert take_prompt_logprobs(req, StepResult(3, prompt_logprobs={"a": overlap})).start == 3
    assert not req.needs_prompt_logprobs and req.sampling.prompt_logprobs is None  # a recompute computes none
    assert req.sampling.logprobs == 2


def test_limits_and_codec_round_trip():
    with pytest.raises(limits.LimitError) as info:
        limits.check_sampling(SamplingParams(logprobs=21), vocab_size=100)
    assert info.value.field == "sampling.logprobs"
    with pytest.raises(limits.LimitError):
        limits.check_sampling(SamplingParams(prompt_logprobs=-1), vocab_size=100)
    assert limits.check_sampling(SamplingParams(logprobs=3), vocab_size=100, max_logprobs=3).logprobs == 3
    sampling = codec.sampling_from_proto(codec.sampling_to_proto(ASKS), 1)
    assert (sampling.logprobs, sampling.prompt_logprobs) == (2, 1)
    plain = codec.sampling_from_proto(codec.sampling_to_proto(SamplingParams()), 1)
    assert (plain.logprobs, plain.prompt_logprobs) == (None, None)
    r = StepResult(3, {"a": 5}, logprobs={"a": Logprobs(5, -0.5, ((5, -0.5), (7, -2.0)))},
                   prompt_logprobs={"a": PromptLogprobs(2, (Logprobs(9, -4.0),))},
                   speculation={"a": SpecOutcome(2, (3,), (Logprobs(3, -0.25, ((3, -0.25),)),))})
    assert codec.result_from_proto(codec.result_to_proto(r)) == r


def test_a_request_asking_prompt_logprobs_never_takes_a_prefix_hit():
    from tests.unit.test_sched_core import driver, greedy

    d = driver()
    prompt = list(range(1, 12))
    d.scheduler.add_request(Request("a", prompt, greedy(2)))
    d.run_until_done()
    d.scheduler.add_request(Request("b", prompt, greedy(2, prompt_logprobs=0)))
    assert d.step()
    [new] = d.plans[-1].new_requests
    assert new.num_computed_tokens == 0  # the whole prompt is computed: its logprobs are needed
    d.run_until_done()
    d.scheduler.add_request(Request("c", prompt, greedy(2)))  # without: the cache serves it again
    assert d.step()
    assert d.plans[-1].new_requests[0].num_computed_tokens == 8


def test_a_worker_without_logprobs_refuses_rows_asking_for_them_alone():
    from stepahead.plan import NewRequest, StepPlan
    from worker_service.plan_checks import split_bad_sampling_rows

    rows = [NewRequest(rid, (1, 2), s, (0,), 0, 2) for rid, s in
            (("asks", ASKS), ("plain", SamplingParams(max_tokens=4)), ("big", SamplingParams(max_tokens=4, logprobs=5)))]
    plan, failed = split_bad_sampling_rows(StepPlan(0, new_requests=tuple(rows)), 100, set(), max_logprobs=None)
    assert [r.request_id for r in plan.new_requests] == ["plain"]
    assert "does not compute logprobs" in failed["asks"] and "big" in failed
    plan, failed = split_bad_sampling_rows(StepPlan(0, new_requests=tuple(rows)), 100, set(), max_logprobs=4)
    assert [r.request_id for r in plan.new_requests] == ["asks", "plain"] and "[0, 4]" in failed["big"]
