"""The one set of request limits, shared by every daemon (pure Python, no torch, no grpc).

The gateway checks a public request with it, the scheduler checks every submission again
(a gateway is just a network peer), and the worker checks each plan's sampling rows before
launching. Floats are judged in the dtype the worker samples in, float32: a value that
is fine as a float64 but vanishes, overflows or turns NaN in float32 is caught here, not
in a device kernel that would fail every request of the step.

The rules (each names its field in the error; `check_*` return the normalised value):

| field | accepted | normalised |
|---|---|---|
| temperature | finite, 0 ≤ t ≤ 100 | t < 1e-5 (incl. -0.0, subnormals, values that are 0 in float32) → 0, greedy (vLLM's rule) |
| top_p | finite, 0 < p ≤ 1 | p < 1e-6 → 1e-6 (keeps only the most likely token, as any p ≤ 1/vocab does); p that rounds to 1 in float32 → 1 (off) |
| min_p | finite, 0 ≤ p ≤ 1 | p below float32's smallest normal number → 0 (off) |
| top_k | -1 ≤ k < 2^31 | 0 and k ≥ vocab mean off |
| seed | signed 64-bit | |
| max_tokens | 1 ≤ n, prompt + n ≤ max_model_len | unset → what the model has room for |
| min_tokens | 0 ≤ n ≤ max_tokens | |
| stop_token_ids, prompt ids | 0 ≤ id < vocab_size; ≤ 64 stop ids | |
| prompt | 1 ≤ len < max_model_len | |
| prompt text, chat messages | checked before tokenizing or rendering: ≤ max_model_len × 32 characters of text in all (32: more than any token of a real tokenizer stands for); ≤ 2048 messages; no NUL character | |
| stop | ≤ 16 strings, each 1–256 characters, no NUL character | |
| request | the HTTP body or gRPC message ≤ `--max-request-bytes` (default 1 MiB), checked before it is parsed | |
| priority | -1000 ≤ p ≤ 1000 | |
| n | 1 ≤ n ≤ 16 (the gateway fans a request out into n sequences) | |
| logit_bias | ≤ 1024 distinct ids below vocab_size, each bias finite in [-100, 100] | |
| repetition_penalty | finite, 0 < p ≤ 10 | |
| presence_penalty, frequency_penalty | finite, -2 ≤ p ≤ 2 | |
| logprobs, prompt_logprobs | unset, or 0 ≤ k ≤ max_logprobs (`--max-logprobs` on the worker, announced in its hello; default 20) | |
| request_id, cache_salt | ≤ 256 characters | |
| tools | ≤ 128 functions, each named by 1–64 of `[a-zA-Z0-9_.-]` (OpenAI's rules) | |
| structured_outputs | one constraint; json: a JSON object that is a valid JSON schema (its meta-schema, at the gateway, where the client hears why; the scheduler and the worker check the JSON object and its depth and leave the rest to xgrammar: the meta-schema check of a large schema takes tens of ms, which on their one loop or step thread every stream would wait for); regex: compiles with Python's `re`; choice: 1–256 non-empty strings ≤ 1024 characters; grammar: non-empty; each text ≤ 64 KiB; not with ignore_eos or min_tokens > 0; start_after: ≤ 16 token ids, each below vocab_size | |

Structured outputs are checked here as far as pure Python can; whether xgrammar compiles
the constraint is known only on the worker, which fails that request alone with
INVALID_ARGUMENT (`StepResult.invalid_ids`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jsonschema

from stepahead.logprobs import MAX_LOGPROBS
from stepahead.plan import SamplingParams, StructuredKind, StructuredOutput

MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MIN_TOP_P = 1e-6
FLOAT32_TINY = 2.0**-126  # smallest normal float32
INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)
PRIORITY_RANGE = (-1000, 1000)
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_CHARS_PER_TOKEN = 32  # bounds a text by the model length before the tokenizer sees it
MAX_MESSAGES = 2048
MAX_ID_CHARS = 256  # request ids and cache salts
MAX_REQUEST_BYTES = 1 << 20
MAX_N = 16
MAX_PROMPTS = 256  # prompts in one batched completions request (each a stream of the gateway's limit)
MAX_LOGIT_BIAS_IDS = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_REPETITION_PENALTY = 10.0
PRESENCE_FREQUENCY_RANGE = (-2.0, 2.0)
MAX_STRUCTURED_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_SCHEMA_DEPTH = 64
MAX_START_AFTER_TOKENS = 16  # the token ids a constraint starts after (a reasoning end marker)
MAX_TOOLS = 128  # functions in one chat request (OpenAI's limit)
FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"  # a tool's name (OpenAI's rule)
MAX_PLAIN_TOKEN_STEPS = 1024  # steps a Connect stream's plain tokens may be held (SessionOptions)


class LimitError(ValueError):
    """A field holds a value no daemon accepts; `field` names it as the public API does."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message  # the message without the field name


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts (from the worker's hello)."""

    name: str
    max_model_len: int
    vocab_size: int
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_logprobs: int = MAX_LOGPROBS


def as_float32(value: float) -> float:
    """`value` rounded to float32 as the device will hold it (±inf on overflow)."""
    return ctypes.c_float(value).value


def check_sampling(p: SamplingParams, vocab_size: int, max_logprobs: int = MAX_LOGPROBS, *,
                   meta_schema: bool = True) -> SamplingParams:
    """Every sampling field except the length budget; returns the normalised params.
    `meta_schema=False`: a JSON schema is not checked against its meta-schema (the table)."""
    check_logprobs("sampling.logprobs", p.logprobs, max_logprobs)
    check_logprobs("sampling.prompt_logprobs", p.prompt_logprobs, max_logprobs)
    return dataclasses.replace(
        p,
        temperature=check_temperature(p.temperature),
        top_k=check_top_k(p.top_k),
        top_p=check_top_p(p.top_p),
        min_p=check_min_p(p.min_p),
        seed=check_seed(p.seed),
        min_tokens=check_output_budget(p.max_tokens, p.min_tokens),
        stop_token_ids=check_token_ids("sampling.stop_token_ids", p.stop_token_ids, vocab_size, MAX_STOP_TOKEN_IDS),
        logit_bias=check_logit_bias(p.logit_bias, vocab_size),
        repetition_penalty=check_repetition_penalty(p.repetition_penalty),
        presence_penalty=check_penalty("sampling.presence_penalty", p.presence_penalty),
        frequency_penalty=check_penalty("sampling.frequency_penalty", p.frequency_penalty),
        structured=check_structured(p, vocab_size, meta_schema=meta_schema),
    )


def check_request(prompt_ids: Sequence[int], sampling: SamplingParams, priority: int, model: ModelLimits,
                  prompt_field: str = "prompt.token_ids") -> SamplingParams:
    """A whole submission: prompt, length budget, sampling and priority."""
    check_prompt(prompt_ids, model, prompt_field)
    check_max_tokens(sampling.max_tokens, len(prompt_ids), model.max_model_len)
    check_priority(priority)
    return check_sampling(sampling, model.vocab_size, model.max_logprobs)


def check_logprobs(field: str, value: int | None, max_logprobs: int) -> int | None:
    """None (off) or a k in [0, max_logprobs]."""
    if value is not None and not 0 <= value <= max_logprobs:
        raise LimitError(field, f"must be in [0, {max_logprobs}] (--max-logprobs), got {value}")
    return value


def _finite(field: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or math.isinf(as_float32(value)):
        raise LimitError(field, f"must be a finite float32 number, got {value!r}")
    return float(value)


def check_temperature(value: float) -> float:
    value = _finite("sampling.temperature", value)
    if not 0.0 <= value <= MAX_TEMPERATURE:
        raise LimitError("sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {value!r}")
    return 0.0 if value < GREEDY_BELOW else value


def check_top_p(value: float) -> float:
    value = _finite("sampling.top_p", value)
    if not 0.0 < value <= 1.0:
        raise LimitError("sampling.top_p", f"must be in (0, 1], got {value!r}")
    if as_float32(value) == 1.0:
        return 1.0
    return max(value, MIN_TOP_P)


def check_min_p(value: float) -> float:
    value = _finite("sampling.min_p", value)
    if not 0.0 <= value <= 1.0:
        raise LimitError("sampling.min_p", f"must be in [0, 1], got {value!r}")
    return 0.0 if value < FLOAT32_TINY else value


def check_top_k(value: int) -> int:
    if not -1 <= value <= INT32_MAX:
        raise LimitError("sampling.top_k", f"must be -1 or 0 (disabled) or in [1, {INT32_MAX}], got {value}")
    return value


def check_seed(value: int | None) -> int | None:
    if value is not None and not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise LimitError("sampling.seed", f"must fit in a signed 64-bit integer, got {value}")
    return value


def check_max_tokens(value: int, prompt_len: int, max_model_len: int) -> int:
    if value < 1:
        raise LimitError("sampling.max_tokens", f"must be at least 1, got {value}")
    if prompt_len + value > max_model_len:
        raise LimitError(
            "sampling.max_tokens",
            f"{value} output tokens + {prompt_len} prompt tokens exceed the model's maximum length {max_model_len}",
        )
    return value


def check_output_budget(max_tokens: int, min_tokens: int) -> int:
    """max_tokens >= 1 and 0 <= min_tokens <= max_tokens; returns min_tokens."""
    if max_tokens < 1:
        raise LimitError("sampling.max_tokens", f"must be at least 1, got {max_tokens}")
    if not 0 <= min_tokens <= max_tokens:
        raise LimitError("sampling.min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    return min_tokens


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int, max_count: int | None = None) -> tuple[int, ...]:
    if max_count is not None and len(ids) > max_count:
        raise LimitError(field, f"at most {max_count} ids, got {len(ids)}")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise LimitError(field, f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return tuple(ids)


def check_prompt(ids: Sequence[int], model: ModelLimits, field: str = "prompt.token_ids") -> None:
    if not ids:
        raise LimitError(field, "the prompt is empty")
    if len(ids) >= model.max_model_len:
        raise LimitError(
            field,
            f"the prompt has {len(ids)} tokens; the model's maximum length is {model.max_model_len}"
            " (prompt + at least one output token)",
        )
    check_token_ids(field, ids, model.vocab_size)


def check_priority(value: int) -> int:
    lo, hi = PRIORITY_RANGE
    if not lo <= value <= hi:
        raise LimitError("priority", f"must be in [{lo}, {hi}], got {value}")
    return value


def check_n(value: int) -> int:
    if not 1 <= value <= MAX_N:
        raise LimitError("n", f"must be in [1, {MAX_N}], got {value}")
    return value


def check_prompt_count(count: int) -> int:
    """A completions request's prompts (a batch: a list of texts or of token id lists)."""
    if not 1 <= count <= MAX_PROMPTS:
        raise LimitError("prompt", f"a batch holds 1 to {MAX_PROMPTS} prompts, got {count}")
    return count


def check_tool_count(count: int, field: str = "tools") -> None:
    if count > MAX_TOOLS:
        raise LimitError(field, f"at most {MAX_TOOLS} tools, got {count}")


def check_function_name(field: str, name: str) -> str:
    if re.fullmatch(FUNCTION_NAME, name) is None:
        raise LimitError(field, f"must be 1-64 of a-z, A-Z, 0-9, '_', '.' and '-', got {name[:80]!r}")
    return name


def check_logit_bias_count(count: int) -> None:
    """Before a client's logit_bias map is sorted or copied: its size alone."""
    if count > MAX_LOGIT_BIAS_IDS:
        raise LimitError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_IDS} token ids, got {count}")


def check_logit_bias(bias: Sequence[tuple[int, float]], vocab_size: int) -> tuple[tuple[int, float], ...]:
    field = "sampling.logit_bias"
    check_logit_bias_count(len(bias))
    lo, hi = LOGIT_BIAS_RANGE
    ids = check_token_ids(field, [t for t, _ in bias], vocab_size)
    if len(set(ids)) != len(ids):
        raise LimitError(field, "token ids must be distinct")
    for token_id, value in bias:
        value = _finite(field, value)
        if not lo <= value <= hi:
            raise LimitError(field, f"biases must be in [{lo:g}, {hi:g}], got {value!r} for token {token_id}")
    return tuple((int(t), float(v)) for t, v in bias)


def check_repetition_penalty(value: float) -> float:
    value = _finite("sampling.repetition_penalty", value)
    if not 0.0 < value <= MAX_REPETITION_PENALTY:
        raise LimitError("sampling.repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {value!r}")
    return value


def check_penalty(field: str, value: float) -> float:
    value = _finite(field, value)
    lo, hi = PRESENCE_FREQUENCY_RANGE
    if not lo <= value <= hi:
        raise LimitError(field, f"must be in [{lo:g}, {hi:g}], got {value!r}")
    return value


def check_structured(p: SamplingParams, vocab_size: int, *, meta_schema: bool = True) -> StructuredOutput | None:
    """`p.structured` as far as pure Python can judge it (the worker compiles it);
    `meta_schema=False`: a JSON schema is not checked against its meta-schema."""
    s = p.structured
    if s is None:
        return None
    check_token_ids("structured_outputs.start_after_token_ids", s.start_after, vocab_size, MAX_START_AFTER_TOKENS)
    field = f"structured_outputs.{s.kind.value}"
    if p.ignore_eos:
        raise LimitError("sampling.ignore_eos", "cannot be combined with structured outputs (the grammar ends with EOS)")
    if p.min_tokens:
        raise LimitError("sampling.min_tokens", "cannot be combined with structured outputs")
    if s.kind is StructuredKind.CHOICE:
        return _check_choices(field, s)
    if len(s.spec.encode("utf-8", "surrogatepass")) > MAX_STRUCTURED_SPEC_BYTES:
        raise LimitError(field, f"longer than {MAX_STRUCTURED_SPEC_BYTES} bytes")
    if s.choices:
        raise LimitError(field, "choices are only for a choice constraint")
    if s.kind is StructuredKind.JSON_OBJECT:
        if s.spec:
            raise LimitError(field, "takes no text")
    elif s.kind is StructuredKind.JSON_SCHEMA:
        _check_json_schema(field, s.spec, meta_schema)
    elif s.kind is StructuredKind.REGEX:
        _check_regex(field, s.spec)
    elif not s.spec.strip():
        raise LimitError(field, "the grammar is empty")
    return s


def _check_choices(field: str, s: StructuredOutput) -> StructuredOutput:
    if s.spec:
        raise LimitError(field, "takes its alternatives in choices, not as text")
    if not 1 <= len(s.choices) <= MAX_CHOICES:
        raise LimitError(field, f"needs 1 to {MAX_CHOICES} alternatives, got {len(s.choices)}")
    for c in s.choices:
        if not 1 <= len(c) <= MAX_CHOICE_CHARS:
            raise LimitError(field, f"each alternative must have 1 to {MAX_CHOICE_CHARS} characters")
    return s


def _check_json_schema(field: str, text: str, meta_schema: bool = True) -> None:
    try:
        (_valid_json_schema if meta_schema else _json_object_within_depth)(text)
    except _SchemaProblem as exc:
        raise LimitError(field, str(exc)) from None


class _SchemaProblem(ValueError):
    pass


@functools.lru_cache(maxsize=64)
def _valid_json_schema(text: str) -> None:
    """Raises _SchemaProblem unless `text` is a JSON schema. The valid ones are remembered (the
    meta-schema check takes tens of ms on a schema of many tools, and a client sends the same
    tools with every request): each process checks a schema once. A refusal is not cached."""
    schema = _json_schema_object(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _SchemaProblem(f"is not a valid JSON schema: {exc.message}") from None


@functools.lru_cache(maxsize=64)
def _json_object_within_depth(text: str) -> None:
    """`_json_schema_object`'s check alone, remembered like `_valid_json_schema`'s (the worker
    checks a prepared grammar's schema on its compile thread, then again when the request
    registers on the step thread: the second is a lookup)."""
    _json_schema_object(text)


def _json_schema_object(text: str) -> dict:
    """`text` as a JSON object within the depth bound (checked before jsonschema recurses into it)."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _SchemaProblem(f"is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise _SchemaProblem("must be a JSON object (a JSON schema)")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise _SchemaProblem(f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return schema


def _depth(value, level: int = 0) -> int:
    """How deep JSON containers nest (checked before jsonschema recurses into them)."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return max((_depth(c, level + 1) for c in children), default=level)


def _check_regex(field: str, pattern: str) -> None:
    if not pattern:
        raise LimitError(field, "the regular expression is empty")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise LimitError(field, f"is not a valid regular expression: {exc}") from None


def check_id(field: str, value: str) -> str:
    if len(value) > MAX_ID_CHARS:
        raise LimitError(field, f"longer than {MAX_ID_CHARS} characters")
    if "\0" in value:  # the internal wire packs ids NUL-terminated (`stepahead.columns`)
        raise LimitError(field, "contains a NUL character")
    return value


def check_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise LimitError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not s:
            raise LimitError("stop", "stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise LimitError("stop", f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters")
        _no_nul("stop", s)
    return tuple(stop)


def max_text_chars(max_model_len: int) -> int:
    """The most characters of prompt text worth tokenizing: more cannot fit the model."""
    return max_model_len * MAX_CHARS_PER_TOKEN


def check_prompt_text(text: str, max_model_len: int, field: str = "prompt.text") -> str:
    """A text prompt, judged by its length before tokenizing it costs memory and CPU."""
    limit = max_text_chars(max_model_len)
    if len(text) > limit:
        raise LimitError(field, f"the prompt has {len(text)} characters; at most {limit} fit the model's "
                                f"maximum length {max_model_len} (checked before tokenizing)")
    _no_nul(field, text)
    return text


def check_messages(messages: Sequence[dict], max_model_len: int, field: str = "messages") -> None:
    """A chat, judged by its size before the chat template renders it."""
    if len(messages) > MAX_MESSAGES:
        raise LimitError(field, f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    limit, total = max_text_chars(max_model_len), 0
    for i, message in enumerate(messages):
        for key, value in message.items():
            if key == "tool_calls" and isinstance(value, list):  # an assistant's calls, sized as JSON
                value = json.dumps(value, ensure_ascii=False)
            if not isinstance(value, str):
                raise LimitError(f"{field}[{i}].{key}", "must be a string")
            total += len(value)
            if total > limit:
                raise LimitError(field, f"the messages have more than {limit} characters; at most that many fit "
                                        f"the model's maximum length {max_model_len} (checked before rendering)")
            _no_nul(f"{field}[{i}].{key}", value)


MAX_TEMPLATE_KWARGS = 64
# the tokenizer's special tokens a chat template is given (tokenizer_config.json's keys)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# what the renderer sets itself (transformers' render_jinja_template and the special tokens):
# a request's chat_template_kwargs may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversations", "messages", "tools", "documents", "chat_template", "return_assistant_tokens_mask",
    "continue_final_message", "add_generation_prompt", "tokenize", *SPECIAL_TOKEN_KEYS})


def check_chat_template_kwargs(kwargs: dict, field: str = "chat_template_kwargs") -> dict:
    """Extra variables for the chat template (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    `enable_thinking`): at most `MAX_TEMPLATE_KWARGS` names, none of the renderer's own."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise LimitError(field, f"at most {MAX_TEMPLATE_KWARGS} names, got {len(kwargs)}")
    for name in kwargs:
        if not name.isidentifier():
            raise LimitError(field, f"{name[:64]!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise LimitError(field, f"{name!r} is set by the server, not by a request")
    return kwargs


def _no_nul(field: str, text: str) -> None:
    """NUL is refused in text: C code on the way (tokenizers, templates, logs) may cut there."""
    if "\0" in text:
        raise LimitError(field, "contains a NUL character")


MAX_BLOCK_SIZE = 1024
MAX_MODEL_LEN = 1 << 24
MAX_VOCAB_SIZE = 1 << 24
MAX_BLOCKS = 1 << 26
MAX_TENSOR_PARALLEL_SIZE = 1024
MAX_KV_TRANSFER_BLOCKS = MAX_MODEL_LEN  # one request's blocks at block size 1


def check_worker_info(info) -> None:
    """A worker's hello (`stepahead.plan.WorkerInfo`): geometry a scheduler can plan for."""
    for name, lo, hi in (
        ("block_size", 1, MAX_BLOCK_SIZE),
        ("num_device_blocks", 1, MAX_BLOCKS),
        ("num_host_blocks", 0, MAX_BLOCKS),
        ("max_model_len", 2, MAX_MODEL_LEN),
        ("vocab_size", 1, MAX_VOCAB_SIZE),
        ("max_logprobs", 0, MAX_VOCAB_SIZE),
        ("sliding_window", 0, MAX_MODEL_LEN),
        ("num_offload_blocks", 0, MAX_BLOCKS),
    ):
        value = getattr(info, name)
        if not lo <= value <= hi:
            raise LimitError(name, f"must be in [{lo}, {hi}], got {value}")
    for name in ("worker_id", "model_name", "model_type", "dtype", "device"):
        check_id(name, getattr(info, name))
    check_token_ids("eos_token_ids", info.eos_token_ids, info.vocab_size, MAX_STOP_TOKEN_IDS)
    check_group_place(info.tp_size, info.tp_rank)
    check_id("group_id", info.group_id)
    if (info.tp_size > 1) != bool(info.group_id):
        raise LimitError("group_id", "must be set exactly when tensor_parallel_size > 1")
    check_id("kv_transfer_address", info.kv_transfer_address)
    check_id("kv_transfer_instance", info.kv_transfer_instance)
    if info.role.value != "both" and info.tp_size > 1:
        raise LimitError("role", "disaggregation (a prefill or decode role) needs tensor_parallel_size 1")
    if info.role.value == "prefill" and not info.kv_transfer_address:
        raise LimitError("kv_transfer_address", "must be set on a prefill replica (decode replicas read its KV there)")


def check_kv_blocks(field: str, block_ids, num_blocks: int) -> None:
    """Block ids a peer names (a KV transfer's): at most MAX_KV_TRANSFER_BLOCKS, each in the pool."""
    if len(block_ids) > MAX_KV_TRANSFER_BLOCKS:
        raise LimitError(field, f"at most {MAX_KV_TRANSFER_BLOCKS} blocks per transfer, got {len(block_ids)}")
    bad = next((b for b in block_ids if not 0 <= b < num_blocks), None)
    if bad is not None:
        raise LimitError(field, f"block {bad} is not in the pool of {num_blocks} blocks")


def check_group_place(size: int, rank: int) -> None:
    """A tensor-parallel size and rank (a hello's or a group request's)."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise LimitError("tensor_parallel_size", f"must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {size}")
    if not 0 <= rank < size:
        raise LimitError("tensor_parallel_rank", f"must be in [0, {size}), got {rank}")


def check_plain_token_steps(value: int) -> int:
    """A gateway's `SessionOptions.plain_token_steps`: 0 and 1 both mean every step at once."""
    if not 0 <= value <= MAX_PLAIN_TOKEN_STEPS:
        raise LimitError("options.plain_token_steps", f"must be in [0, {MAX_PLAIN_TOKEN_STEPS}], got {value}")
    return max(value, 1)
