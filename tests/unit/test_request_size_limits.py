"""A prompt is sized before it is tokenized or rendered (refusing it must cost less than
serving it), and NUL characters are refused in text, each error naming its field."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.openai_protocol import openai_param
from gateway.validation import ModelLimits, RawGenerateRequest, ValidationError, validate
from stepahead import limits

LIMITS = ModelLimits(name="tiny", max_model_len=64, vocab_size=100, max_request_bytes=1 << 20)
TEXT_LIMIT = limits.max_text_chars(LIMITS.max_model_len)


def never(*_args):
    raise AssertionError("the prompt was tokenized or rendered before its size was checked")


def ok_tokenize(text: str) -> list[int]:
    return [ord(c) % 100 for c in text][:8]


def _refused(raw: RawGenerateRequest, tokenize=never, render=never) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        validate(raw, LIMITS, tokenize, render)
    return info.value


def test_oversized_text_is_refused_before_tokenizing() -> None:
    error = _refused(RawGenerateRequest(prompt_text="x" * (TEXT_LIMIT + 1), max_tokens=1))
    assert error.field == "prompt.text" and "before tokenizing" in error.reason
    assert openai_param(error.field, chat=False) == "prompt"


def test_text_at_the_limit_reaches_the_tokenizer() -> None:
    valid = validate(RawGenerateRequest(prompt_text="x" * TEXT_LIMIT, max_tokens=1), LIMITS, ok_tokenize, never)
    assert len(valid.prompt_token_ids) == 8


def test_too_many_messages_are_refused_before_rendering() -> None:
    chat = [{"role": "user", "content": "hi"}] * (limits.MAX_MESSAGES + 1)
    error = _refused(RawGenerateRequest(chat_messages=chat, max_tokens=1))
    assert error.field == "messages" and str(limits.MAX_MESSAGES) in error.reason
    assert openai_param(error.field, chat=True) == "messages"


def test_oversized_messages_are_refused_before_rendering() -> None:
    chat = [{"role": "user", "content": "x" * (TEXT_LIMIT // 4)}] * 5
    error = _refused(RawGenerateRequest(chat_messages=chat, max_tokens=1))
    assert error.field == "messages" and "before rendering" in error.reason


def test_one_huge_message_is_refused() -> None:
    error = _refused(RawGenerateRequest(chat_messages=[{"role": "user", "content": "x" * (TEXT_LIMIT + 1)}]))
    assert error.field == "messages"


@pytest.mark.parametrize("raw, field", [
    (RawGenerateRequest(prompt_text="a\0b"), "prompt.text"),
    (RawGenerateRequest(prompt_text="ab", stop=["x", "y\0"]), "stop"),
    (RawGenerateRequest(chat_messages=[{"role": "user", "content": "a\0"}]), "messages[0].content"),
    (RawGenerateRequest(chat_messages=[{"role": "us\0er", "content": "a"}]), "messages[0].role"),
])
def test_nul_is_refused_naming_the_field(raw: RawGenerateRequest, field: str) -> None:
    error = _refused(dataclasses.replace(raw, max_tokens=1))
    assert error.field == field and "NUL" in error.reason
