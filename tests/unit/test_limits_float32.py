"""Floats are judged as the worker will hold them, float32: a value finite as a float64 but
infinite in float32 is refused as such, in every float field (not only by a range check
that happens to cover it today)."""

from __future__ import annotations

import dataclasses

import pytest

from stepahead import limits
from stepahead.plan import SamplingParams

OVERFLOW = 1e39  # finite in float64, +inf in float32
BASE = SamplingParams(max_tokens=4)

FIELDS = {
    "sampling.temperature": dict(temperature=OVERFLOW),
    "sampling.top_p": dict(top_p=OVERFLOW),
    "sampling.min_p": dict(min_p=OVERFLOW),
    "sampling.repetition_penalty": dict(repetition_penalty=OVERFLOW),
    "sampling.presence_penalty": dict(presence_penalty=-OVERFLOW),
    "sampling.frequency_penalty": dict(frequency_penalty=OVERFLOW),
    "sampling.logit_bias": dict(logit_bias=((3, OVERFLOW),)),
}


def test_the_value_overflows_only_in_float32() -> None:
    assert OVERFLOW < float("inf") and limits.as_float32(OVERFLOW) == float("inf")


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_float32_overflow_is_refused_as_such(field: str) -> None:
    with pytest.raises(limits.LimitError) as info:
        limits.check_sampling(dataclasses.replace(BASE, **FIELDS[field]), vocab_size=100)
    assert info.value.field == field
    assert "finite float32" in info.value.reason


@pytest.mark.parametrize("value", [OVERFLOW, -OVERFLOW, 3.5e38])
def test_finite_check_refuses_float32_overflow(value: float) -> None:
    with pytest.raises(limits.LimitError, match="finite float32"):
        limits._finite("x", value)


def test_largest_float32_is_finite() -> None:
    assert limits._finite("x", 3.4e38) == 3.4e38
