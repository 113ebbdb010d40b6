"""Every bad field is rejected with a message that names it; good requests pass through."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.validation import ModelLimits, RawGenerateRequest, ValidationError, validate

LIMITS = ModelLimits(name="tiny", max_model_len=64, vocab_size=100, max_request_bytes=1000)


def tokenize(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


GOOD = RawGenerateRequest(prompt_text="hello", max_tokens=8)

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
        validate(dataclasses.replace(GOOD, **changes), LIMITS, tokenize)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def test_good_request_defaults() -> None:
    valid = validate(GOOD, LIMITS, tokenize)
    assert valid.prompt_token_ids == tuple(tokenize("hello"))
    assert valid.sampling.temperature == 1.0 and valid.sampling.top_p == 1.0
    assert valid.sampling.max_tokens == 8
    assert valid.skip_special_tokens is True


def test_unset_max_tokens_fills_the_model_length() -> None:
    valid = validate(dataclasses.replace(GOOD, max_tokens=None), LIMITS, tokenize)
    assert valid.sampling.max_tokens == LIMITS.max_model_len - len("hello")


def test_edges_are_accepted() -> None:
    edge = dataclasses.replace(
        GOOD, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, priority=1000, max_tokens=64 - 5, stop=["a"] * 16
    )
    valid = validate(edge, LIMITS, tokenize)
    assert valid.sampling.greedy and valid.priority == 1000


def test_vanishing_temperature_is_greedy() -> None:
    assert validate(dataclasses.replace(GOOD, temperature=1e-7), LIMITS, tokenize).sampling.greedy
