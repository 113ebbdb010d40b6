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
