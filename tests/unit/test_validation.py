"""Every bad field is rejected with a message that names it; good requests pass through."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.validation import ModelLimits, RawGenerateRequest, ValidationError, validate
from stepahead import limits
from stepahead.plan import SamplingParams

LIMITS = ModelLimits(name="tiny", max_model_len=64, vocab_size=100, max_request_bytes=1000)


def tokenize(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


GOOD = RawGenerateRequest(prompt_text="hello", max_tokens=8)
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"max_tokens"}


def changed(**changes) -> RawGenerateRequest:
    """GOOD with some fields changed, sampling ones in its `sampling` (as a transport maps them)."""
    sampling = {k: tuple(v) if isinstance(v, list) else v for k, v in changes.items() if k in SAMPLING_FIELDS}
    rest = {k: v for k, v in changes.items() if k not in SAMPLING_FIELDS}
    return dataclasses.replace(GOOD, sampling=dataclasses.replace(GOOD.sampling, **sampling), **rest)

BAD = {
    "empty text": (dict(prompt_text=""), "prompt.text"),
    "empty ids": (dict(prompt_text=None, prompt_token_ids=[]), "prompt.token_ids"),
    "no prompt": (dict(prompt_text=None), "prompt"),
    "prompt too long": (dict(prompt_text="x" * 64), "prompt.text"),
    "max_tokens 0": (dict(max_tokens=0), "sampling.max_tokens"),
    "max_tokens too big": (dict(max_tokens=60), "sampling.max_tokens"),
    "temperature < 0": (dict(temperature=-0.5), "sampling.temperature"),
    "temperature nan": (dict(temperature=float("nan")), "sampling.temperature"),
    "top_p 0": (dict(top_p=0.0), "sampling.top_p"),
    "top_p > 1": (dict(top_p=1.5), "sampling.top_p"),
    "top_k < -1": (dict(top_k=-2), "sampling.top_k"),
    "min_p < 0": (dict(min_p=-0.1), "sampling.min_p"),
    "min_p > 1": (dict(min_p=1.1), "sampling.min_p"),
    "token id outside vocab": (dict(prompt_text=None, prompt_token_ids=[1, 100]), "prompt.token_ids"),
    "stop token outside vocab": (dict(stop_token_ids=[100]), "sampling.stop_token_ids"),
    "too many stops": (dict(stop=["a"] * 17), "stop"),
    "empty stop": (dict(stop=[""]), "stop"),
    "oversized": (dict(size_bytes=1001), "request"),
    "unknown model": (dict(model="gpt-9"), "model"),
    "priority too low": (dict(priority=-1001), "priority"),
    "priority too high": (dict(priority=1001), "priority"),
    "min_tokens > max_tokens": (dict(min_tokens=9), "sampling.min_tokens"),
    "request id too long": (dict(request_id="r" * 300), "request_id"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_field_is_named(case: str) -> None:
    changes, field = BAD[case]
    with pytest.raises(ValidationError) as info:
        validate(changed(**changes), LIMITS, tokenize)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def test_good_request_defaults() -> None:
    valid = validate(GOOD, LIMITS, tokenize)
    assert valid.prompt_token_ids == tuple(tokenize("hello"))
    assert valid.sampling.temperature == 1.0 and valid.sampling.top_p == 1.0
    assert valid.sampling.max_tokens == 8
    assert valid.skip_special_tokens is True


def test_unset_max_tokens_fills_the_model_length() -> None:
    valid = validate(changed(max_tokens=None), LIMITS, tokenize)
    assert valid.sampling.max_tokens == LIMITS.max_model_len - len("hello")


def test_edges_are_accepted() -> None:
    edge = changed(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, priority=1000, max_tokens=64 - 5, stop=["a"] * 16
    )
    valid = validate(edge, LIMITS, tokenize)
    assert valid.sampling.greedy and valid.priority == 1000


def test_vanishing_temperature_is_greedy() -> None:
    assert validate(changed(temperature=1e-7), LIMITS, tokenize).sampling.greedy


# The float32 class (issue: top_p = 1e-46 passed as a float64 but is 0 on the device and
# crashed every request of the step). Each value is either rejected naming the field, or
# normalised to a value that is representable, non-zero where it must be, and finite in
# float32 — the dtype the worker samples in.
F32_SUBNORMAL_MIN = 2.0**-149
FLOAT32_CASES = {
    "top_p below float32's smallest subnormal": (dict(top_p=1e-46), ("top_p", limits.MIN_TOP_P)),
    "top_p float32 subnormal": (dict(top_p=F32_SUBNORMAL_MIN), ("top_p", limits.MIN_TOP_P)),
    "top_p just below 1 rounds to 1 in float32": (dict(top_p=1 - 1e-12), ("top_p", 1.0)),
    "top_p -0.0": (dict(top_p=-0.0), "sampling.top_p"),
    "top_p inf": (dict(top_p=float("inf")), "sampling.top_p"),
    "top_p nan": (dict(top_p=float("nan")), "sampling.top_p"),
    "temperature denormal": (dict(temperature=5e-324), ("temperature", 0.0)),
    "temperature below float32 subnormal": (dict(temperature=1e-46), ("temperature", 0.0)),
    "temperature -0.0": (dict(temperature=-0.0), ("temperature", 0.0)),
    "temperature overflows float32": (dict(temperature=1e39), "sampling.temperature"),
    "temperature -inf": (dict(temperature=float("-inf")), "sampling.temperature"),
    "min_p denormal": (dict(min_p=5e-324), ("min_p", 0.0)),
    "min_p float32 subnormal": (dict(min_p=1e-40), ("min_p", 0.0)),
    "min_p nan": (dict(min_p=float("nan")), "sampling.min_p"),
    "min_p -inf": (dict(min_p=float("-inf")), "sampling.min_p"),
    "top_k int32 overflow": (dict(top_k=2**31), "sampling.top_k"),
    "top_k -7": (dict(top_k=-7), "sampling.top_k"),
    "seed beyond int64": (dict(seed=2**63), "sampling.seed"),
    "huge max_tokens": (dict(max_tokens=2**40), "sampling.max_tokens"),
    "huge token id": (dict(prompt_text=None, prompt_token_ids=[10**6]), "prompt.token_ids"),
    "negative token id": (dict(prompt_text=None, prompt_token_ids=[-1]), "prompt.token_ids"),
}


@pytest.mark.parametrize("case", sorted(FLOAT32_CASES))
def test_float32_class_is_rejected_or_normalised(case: str) -> None:
    changes, expect = FLOAT32_CASES[case]
    raw = changed(**changes)
    if isinstance(expect, str):
        with pytest.raises(ValidationError) as info:
            validate(raw, LIMITS, tokenize)
        assert info.value.field == expect
        return
    name, value = expect
    got = getattr(validate(raw, LIMITS, tokenize).sampling, name)
    assert got == value
    assert got == limits.as_float32(got) or 0 < limits.as_float32(got)  # representable, not vanished
    assert not (got and limits.as_float32(got) == 0.0)


def test_normalisation_is_idempotent() -> None:
    """The scheduler and the worker apply the same rules again: a checked request passes unchanged."""
    for changes, expect in FLOAT32_CASES.values():
        if isinstance(expect, str):
            continue
        once = validate(changed(**changes), LIMITS, tokenize).sampling
        assert limits.check_sampling(once, LIMITS.vocab_size) == once
