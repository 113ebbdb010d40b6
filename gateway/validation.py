"""Validation of public generation requests (pure domain code, no grpc).

`validate()` turns what a client asked (`RawGenerateRequest`) into a `ValidRequest` or
raises `ValidationError` naming the offending field. The servicer maps that error to
INVALID_ARGUMENT (gRPC) or HTTP 400.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stepahead.plan import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256
PRIORITY_RANGE = (-1000, 1000)
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_N = 16
MAX_LOGIT_BIAS_IDS = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)
REPETITION_PENALTY_MAX = 10.0
PRESENCE_FREQUENCY_RANGE = (-2.0, 2.0)


class ValidationError(ValueError):
    """A request field holds a value the server cannot accept."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts."""

    name: str
    max_model_len: int
    vocab_size: int
    max_request_bytes: int = 1 << 20


@dataclass(frozen=True)
class RawGenerateRequest:
    """A request as the client sent it; None means the field was not set."""

    request_id: str = ""
    model: str = ""
    prompt_text: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    temperature: float | None = None
    top_k: int = -1
    top_p: float | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    priority: int = 0
    n: int = 1  # independent output sequences for the prompt
    logit_bias: Mapping[int, float] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    size_bytes: int = 0  # serialized size of the whole request


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int
    n: int = 1


def validate(
    raw: RawGenerateRequest, limits: ModelLimits, tokenize: Callable[[str], list[int]]
) -> ValidRequest:
    _check_envelope(raw, limits)
    prompt = _prompt_ids(raw, limits, tokenize)
    max_tokens = _max_tokens(raw, limits, len(prompt))
    sampling = SamplingParams(
        temperature=_temperature(raw.temperature),
        top_k=_top_k(raw.top_k),
        top_p=_top_p(raw.top_p),
        min_p=_min_p(raw.min_p),
        seed=_seed(raw.seed),
        max_tokens=max_tokens,
        min_tokens=_min_tokens(raw.min_tokens, max_tokens),
        stop_token_ids=_stop_token_ids(raw.stop_token_ids, limits),
        ignore_eos=raw.ignore_eos,
        logit_bias=_logit_bias(raw.logit_bias, limits),
        repetition_penalty=_repetition_penalty(raw.repetition_penalty),
        presence_penalty=_penalty("sampling.presence_penalty", raw.presence_penalty),
        frequency_penalty=_penalty("sampling.frequency_penalty", raw.frequency_penalty),
    )
    return ValidRequest(
        request_id=raw.request_id,
        prompt_token_ids=tuple(prompt),
        sampling=sampling,
        stop=_stop_strings(raw.stop),
        include_stop_str_in_output=raw.include_stop_str_in_output,
        skip_special_tokens=True if raw.skip_special_tokens is None else raw.skip_special_tokens,
        priority=_priority(raw.priority),
        n=_n(raw.n),
    )


def _check_envelope(raw: RawGenerateRequest, limits: ModelLimits) -> None:
    if raw.size_bytes > limits.max_request_bytes:
        raise ValidationError(
            "request", f"message is {raw.size_bytes} bytes; the limit is {limits.max_request_bytes}"
        )
    if raw.model and raw.model != limits.name:
        raise ValidationError("model", f"unknown model {raw.model!r}; this server serves {limits.name!r}")
    if len(raw.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValidationError("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")


def _prompt_ids(raw: RawGenerateRequest, limits: ModelLimits, tokenize: Callable[[str], list[int]]) -> list[int]:
    if raw.prompt_token_ids is not None:
        ids = list(raw.prompt_token_ids)
        field = "prompt.token_ids"
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise ValidationError(field, f"token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})")
    elif raw.prompt_text is not None:
        field = "prompt.text"
        ids = tokenize(raw.prompt_text) if raw.prompt_text else []
    else:
        raise ValidationError("prompt", "set prompt.text or prompt.token_ids")
    if not ids:
        raise ValidationError(field, "the prompt is empty")
    if len(ids) >= limits.max_model_len:
        raise ValidationError(
            field,
            f"the prompt has {len(ids)} tokens; the model's maximum length is {limits.max_model_len}"
            " (prompt + at least one output token)",
        )
    return ids


def _max_tokens(raw: RawGenerateRequest, limits: ModelLimits, prompt_len: int) -> int:
    room = limits.max_model_len - prompt_len
    if raw.max_tokens is None:
        return room
    if raw.max_tokens < 1:
        raise ValidationError("sampling.max_tokens", f"must be at least 1, got {raw.max_tokens}")
    if raw.max_tokens > room:
        raise ValidationError(
            "sampling.max_tokens",
            f"{raw.max_tokens} output tokens + {prompt_len} prompt tokens exceed the model's"
            f" maximum length {limits.max_model_len}",
        )
    return raw.max_tokens


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValidationError(field, f"must be a finite number, got {value}")
    return value


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0
    _finite("sampling.temperature", value)
    if not 0.0 <= value <= MAX_TEMPERATURE:
        raise ValidationError("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE}], got {value}")
    return 0.0 if value < GREEDY_BELOW else value  # as vLLM: a vanishing temperature is greedy


def _top_k(value: int) -> int:
    if value < -1:
        raise ValidationError("sampling.top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {value}")
    return value


def _top_p(value: float | None) -> float:
    if value is None:
        return 1.0
    _finite("sampling.top_p", value)
    if not 0.0 < value <= 1.0:
        raise ValidationError("sampling.top_p", f"must be in (0, 1], got {value}")
    return value


def _min_p(value: float) -> float:
    _finite("sampling.min_p", value)
    if not 0.0 <= value <= 1.0:
        raise ValidationError("sampling.min_p", f"must be in [0, 1], got {value}")
    return value


def _seed(value: int | None) -> int | None:
    if value is not None and not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise ValidationError("sampling.seed", "must fit in a signed 64-bit integer")
    return value


def _min_tokens(value: int, max_tokens: int) -> int:
    if value < 0:
        raise ValidationError("sampling.min_tokens", f"must be >= 0, got {value}")
    if value > max_tokens:
        raise ValidationError("sampling.min_tokens", f"{value} is more than max_tokens ({max_tokens})")
    return value


def _stop_token_ids(ids: Sequence[int], limits: ModelLimits) -> tuple[int, ...]:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValidationError("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    for t in ids:
        if not 0 <= t < limits.vocab_size:
            raise ValidationError(
                "sampling.stop_token_ids", f"token id {t} is outside the vocabulary [0, {limits.vocab_size})"
            )
    return tuple(ids)


def _stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise ValidationError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not s:
            raise ValidationError("stop", "stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValidationError("stop", f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters")
    return tuple(stop)


def _priority(value: int) -> int:
    lo, hi = PRIORITY_RANGE
    if not lo <= value <= hi:
        raise ValidationError("priority", f"must be in [{lo}, {hi}], got {value}")
    return value


def _n(value: int) -> int:
    if not 1 <= value <= MAX_N:
        raise ValidationError("n", f"must be in [1, {MAX_N}], got {value}")
    return value


def _logit_bias(bias: Mapping[int, float] | None, limits: ModelLimits) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    field = "sampling.logit_bias"
    if len(bias) > MAX_LOGIT_BIAS_IDS:
        raise ValidationError(field, f"at most {MAX_LOGIT_BIAS_IDS} token ids, got {len(bias)}")
    lo, hi = LOGIT_BIAS_RANGE
    for token_id, value in bias.items():
        if not 0 <= token_id < limits.vocab_size:
            raise ValidationError(field, f"token id {token_id} is outside the vocabulary [0, {limits.vocab_size})")
        _finite(field, value)
        if not lo <= value <= hi:
            raise ValidationError(field, f"biases must be in [{lo}, {hi}], got {value} for token {token_id}")
    return tuple(sorted(bias.items()))


def _repetition_penalty(value: float | None) -> float:
    if value is None:
        return 1.0
    _finite("sampling.repetition_penalty", value)
    if not 0.0 < value <= REPETITION_PENALTY_MAX:
        raise ValidationError("sampling.repetition_penalty", f"must be in (0, {REPETITION_PENALTY_MAX}], got {value}")
    return value


def _penalty(field: str, value: float) -> float:
    _finite(field, value)
    lo, hi = PRESENCE_FREQUENCY_RANGE
    if not lo <= value <= hi:
        raise ValidationError(field, f"must be in [{lo}, {hi}], got {value}")
    return value
