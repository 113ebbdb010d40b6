"""OpenAI-compatible request bodies and their mapping onto `RawGenerateRequest` (sampling: `_sampling`).

Pure domain code (pydantic, no transport). Field names, defaults and vLLM's extra sampling
fields follow the OpenAI completions / chat completions APIs. Unknown fields are ignored
(as vLLM does); known fields are type-checked strictly, so `"max_tokens": "5"` is an error
naming the field rather than a silent conversion.

Parameters this server cannot honour (`suffix`, `best_of` != n) are refused with a
400 that names them, never silently ignored. Tools (`tools`, `tool_choice`,
`parallel_tool_calls`): `chat_parsing` says how the output is read back, `chat_to_raw`
renders the tools and enforces `required` / a named function as a JSON schema.
Logprobs: completions `logprobs=k` (0: the sampled token only; with `echo`, the prompt's too); chat `logprobs: true` with an optional
`top_logprobs` (absent means 0).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.chat_output import ChatParsing
from gateway.chat_output import chat_parsing as tool_parsing
from gateway.reasoning_parsers import ReasoningParser
from gateway.tool_choice import ToolMode, ToolRequest, ToolSpec, call_arguments
from gateway.tool_parsers import ToolCallParser
from gateway.validation import RawGenerateRequest, ValidationError
from stepahead import limits
from stepahead.plan import SamplingParams, StructuredKind, StructuredOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI completions default


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by both endpoints (OpenAI's plus vLLM's extras). Fields it does not
    declare are kept (`model_extra`) so that `check_unsupported` can refuse the ones that
    would change the output; the rest are ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(_Strict):
    name: str = Field(pattern=limits.FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the model continues the last message (set add_generation_prompt false)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables (Qwen3's enable_thinking)
    tools: list[ChatTool] | None = Field(None, max_length=limits.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeCompletionRequest(_Strict):
    """vLLM's `POST /tokenize` with a `prompt`."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Strict):
    """vLLM's `POST /tokenize` with `messages` (rendered with the chat template, which holds its
    special tokens: none are added unless `add_special_tokens`)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None


class DetokenizeRequest(_Strict):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


# vLLM's request fields this server does not implement, each with the values that ask for
# nothing (a client that sends every field with its default is served) and what to do instead.
# Any other value is refused: ignoring it would change the output without a word.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0, 1), "beam search is not supported"),
    "guided_json": ((None,), "use structured_outputs.json or response_format (vLLM's current names)"),
    "guided_regex": ((None,), "use structured_outputs.regex"),
    "guided_choice": ((None,), "use structured_outputs.choice"),
    "guided_grammar": ((None,), "use structured_outputs.grammar"),
    "guided_decoding_backend": ((None,), "use structured_outputs (xgrammar is the backend)"),
    "truncate_prompt_tokens": ((None,), "is not supported: send a prompt that fits the model's length"),
    "bad_words": ((None, []), "is not supported (logit_bias of -100 bans a token)"),
    "allowed_token_ids": ((None, []), "is not supported (structured_outputs.choice or a regex can restrict the output)"),
    "prompt_logprobs": ((None,), "is not supported here (completions: echo with logprobs returns the prompt's)"),
    "return_tokens_as_token_ids": ((None, False), "is not supported (/tokenize gives ids)"),
    "chat_template": ((None,), "is not supported: the model's own template renders every chat"),
    "documents": ((None, []), "is not supported"),
    "logits_processors": ((None, []), "is not supported"),
    "echo": ((None, False), "is not supported in chat (completions have echo)"),
    # OpenAI's chat fields that ask for output this server does not make: refused, not a
    # silent text-only answer
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
}


def check_unsupported(body: _SamplingFields) -> None:
    """Refuse a field of `UNSUPPORTED_FIELDS` that asks for something (400 naming it)."""
    for name, value in (body.model_extra or {}).items():
        known = UNSUPPORTED_FIELDS.get(name)
        if known is not None and not any(value == neutral and type(value) is type(neutral) for neutral in known[0]):
            raise ValidationError(name, known[1])


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI sends token ids as JSON object keys (strings); the domain's form is sorted pairs."""
    if not bias:
        return ()
    limits.check_logit_bias_count(len(bias))  # before a huge map is converted and sorted
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise ValidationError("logit_bias", f"keys must be token ids, got {key!r}")
        out[int(key)] = value
    return tuple(sorted(out.items()))


def _stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _structured(body: _SamplingFields) -> StructuredOutput | None:
    """vLLM's `structured_outputs` or OpenAI's `response_format` (not both) as one constraint."""
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if body.structured_outputs is not None:
            raise ValidationError("response_format", "set response_format or structured_outputs, not both")
        if fmt.type == "json_object":
            return StructuredOutput(StructuredKind.JSON_OBJECT)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValidationError("response_format.json_schema.schema", "is required with type json_schema")
        return StructuredOutput(StructuredKind.JSON_SCHEMA, spec=json.dumps(fmt.json_schema.schema_))
    so = body.structured_outputs
    if so is None:
        return None
    given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                 ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None]
    if len(given) != 1:
        raise ValidationError("structured_outputs", "set exactly one of json, regex, choice, grammar, json_object")
    key, value = given[0]
    if key == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    if key == "choice":
        return StructuredOutput(StructuredKind.CHOICE, choices=tuple(value))
    if key == "json" and not isinstance(value, str):
        value = json.dumps(value)
    return StructuredOutput(StructuredKind(key), spec=value)


def _sampling(body: _SamplingFields, *, logprobs: int | None = None,
              prompt_logprobs: int | None = None) -> SamplingParams:
    """The body's sampling settings as the domain's (the one pydantic -> domain mapping; unset
    fields take `SamplingParams`' defaults; max_tokens travels apart, see RawGenerateRequest)."""
    given = dict(temperature=body.temperature, top_p=body.top_p, repetition_penalty=body.repetition_penalty)
    return SamplingParams(
        **{name: value for name, value in given.items() if value is not None},
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logit_bias=_logit_bias(body.logit_bias),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        structured=_structured(body),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _common(body: _SamplingFields, max_tokens: int | None, size_bytes: int) -> dict[str, Any]:
    """The RawGenerateRequest fields both endpoints share, sampling aside."""
    return dict(
        model=body.model or "",
        n=body.n,
        stop=_stop(body.stop),
        max_tokens=max_tokens,
        priority=body.priority,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        size_bytes=size_bytes,
    )


def echo_only(body: CompletionRequest) -> bool:
    """`echo` with `max_tokens: 0`: the prompt (and its logprobs) back, nothing generated, as
    OpenAI and vLLM allow (lm-eval scores a text this way). One token is generated upstream,
    as vLLM does, and left out of the response."""
    return body.echo and body.max_tokens == 0


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one (a text or token ids), or a batch (a list of either), which
    is answered as one response with `n` choices per prompt, as OpenAI and vLLM do."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        limits.check_prompt_count(len(prompt))
        return list(prompt)
    return [prompt]


def completion_to_raw(body: CompletionRequest, size_bytes: int,
                      prompt: str | list[int] | None = None) -> RawGenerateRequest:
    """The generation request for `prompt`, one of a batch's (`completion_prompts`); by
    default the request's one prompt."""
    if prompt is None:
        (prompt,) = completion_prompts(body)
    if body.best_of is not None and body.best_of != body.n:
        raise ValidationError("best_of", "is not supported (only best_of == n)")
    if body.suffix:
        raise ValidationError("suffix", "is not supported")
    check_unsupported(body)
    text = prompt if isinstance(prompt, str) else None
    ids = None if isinstance(prompt, str) else list(prompt)
    # echo with logprobs: the prompt's logprobs come first (OpenAI's format)
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    return RawGenerateRequest(prompt_text=text, prompt_token_ids=ids,
                              sampling=_sampling(body, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs),
                              **_common(body, 1 if echo_only(body) else body.max_tokens, size_bytes))


def message_dict(message: ChatMessage, index: int = 0) -> dict[str, Any]:
    """A message as chat templates take it (transformers' convention: a call's `arguments`
    an object, not JSON text)."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": call_arguments(call.function.arguments, f"messages[{index}].tool_calls[{j}].function.arguments")}}
                             for j, call in enumerate(message.tool_calls)]
    return out


def tool_dicts(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's `{"type": "function", "function": ...}`)."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def tool_request(body: ChatCompletionRequest) -> ToolRequest:
    """The request's tools and `tool_choice` in the domain's form."""
    choice = body.tool_choice
    specs = tuple(ToolSpec(t.function.name, t.function.parameters) for t in body.tools or ())
    if isinstance(choice, NamedToolChoice):
        return ToolRequest(specs, None, choice.function.name, body.parallel_tool_calls)
    return ToolRequest(specs, None if choice is None else ToolMode(choice), None, body.parallel_tool_calls)


def chat_parsing(body: ChatCompletionRequest, tool_parser: ToolCallParser | None,
                 reasoning: ReasoningParser | None) -> ChatParsing:
    """How this request's output is read (`chat_output.chat_parsing`; default: `auto` with
    tools, as OpenAI)."""
    return tool_parsing(tool_request(body), tool_parser, reasoning)


def chat_to_raw(body: ChatCompletionRequest, size_bytes: int) -> RawGenerateRequest:
    check_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationError("top_logprobs", "requires logprobs to be true")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise ValidationError("max_completion_tokens", "set max_completion_tokens or max_tokens, not both")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # logprobs=true alone: the sampled token's
    sampling = _sampling(body, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    tools = tool_request(body).forced()
    if tools is not None:
        sampling = tools.constrain(sampling)
    return RawGenerateRequest(
        chat_messages=[message_dict(m, i) for i, m in enumerate(body.messages)],
        chat_tools=tool_dicts(body.tools), add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs,
        sampling=sampling, **_common(body, max_tokens, size_bytes),
    )


def openai_param(field: str, *, chat: bool) -> str | None:
    """The request parameter a `ValidationError` field names, in OpenAI's vocabulary."""
    if field == "prompt" or field.startswith(("prompt.", "prompt[")):
        return "messages" if chat else "prompt"
    if field == "request":
        return None
    name = field.removeprefix("sampling.")
    if chat and name == "max_tokens":
        return "max_completion_tokens"
    if field == "sampling.prompt_logprobs":  # completions ask for them with echo + logprobs
        return "logprobs"
    if chat and field == "sampling.logprobs":  # a k out of range: chat's k is top_logprobs
        return "top_logprobs"
    return name
