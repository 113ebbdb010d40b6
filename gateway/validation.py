"""Validation of public generation requests (pure domain code, no grpc).

`validate()` turns what a client asked (`RawGenerateRequest`) into a `ValidRequest` or
raises `ValidationError` naming the offending field. The rules are `stepahead.limits`, the
same ones the scheduler applies again to every submission. The servicer maps the error to
INVALID_ARGUMENT (gRPC) or HTTP 400.

Text and chat prompts are sized (characters, messages) before they are tokenized or
rendered: refusing a prompt must cost less than serving it, so a burst of oversized
prompts cannot grow the gateway by the tokenizer's working memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stepahead import limits
from stepahead.limits import LimitError as ValidationError
from stepahead.limits import ModelLimits
from stepahead.plan import SamplingParams

__all__ = ["ModelLimits", "RawGenerateRequest", "ValidRequest", "ValidationError", "chat_options", "validate"]


@dataclass(frozen=True)
class RawGenerateRequest:
    """A request as a transport decoded it. `sampling` is already the domain's
    `SamplingParams` (each transport maps its fields once: the codec for gRPC,
    `openai_protocol` for HTTP; unset fields take its defaults), not checked yet.
    `max_tokens` stands apart: unset (None), it is the room the prompt leaves, known only
    once the prompt is tokenized here."""

    request_id: str = ""
    model: str = ""
    prompt_text: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    chat_messages: Sequence[Mapping[str, object]] | None = None  # rendered with the chat template
    chat_tools: Sequence[Mapping[str, object]] | None = None  # the tools the template is given (OpenAI's form)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last message, which the model continues
    chat_template_kwargs: Mapping[str, object] | None = None  # more variables for the template
    sampling: SamplingParams = SamplingParams()  # its max_tokens is `max_tokens` below
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    priority: int = 0
    n: int = 1  # independent output sequences (choices) for the prompt
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
    raw: RawGenerateRequest, model: ModelLimits, tokenize: Callable[[str], list[int]],
    render_chat: Callable[..., list[int]] | None = None,
) -> ValidRequest:
    """`render_chat(messages, add_generation_prompt, tools)` turns `chat_messages` into prompt ids."""
    _check_envelope(raw, model)
    stop = limits.check_stop_strings(raw.stop)
    prompt, field = _prompt_ids(raw, model, tokenize, render_chat)
    room = model.max_model_len - len(prompt)
    max_tokens = max(room, 1) if raw.max_tokens is None else raw.max_tokens
    sampling = dataclasses.replace(raw.sampling, max_tokens=max_tokens)
    sampling = limits.check_request(prompt, sampling, raw.priority, model, field)
    return ValidRequest(
        request_id=raw.request_id,
        prompt_token_ids=tuple(prompt),
        sampling=sampling,
        stop=stop,
        include_stop_str_in_output=raw.include_stop_str_in_output,
        skip_special_tokens=True if raw.skip_special_tokens is None else raw.skip_special_tokens,
        priority=raw.priority,
        n=limits.check_n(raw.n),
    )


def _check_envelope(raw: RawGenerateRequest, model: ModelLimits) -> None:
    if raw.size_bytes > model.max_request_bytes:
        raise ValidationError(
            "request", f"message is {raw.size_bytes} bytes; the limit is {model.max_request_bytes}"
        )
    if raw.model and raw.model != model.name:
        raise ValidationError("model", f"unknown model {raw.model!r}; this server serves {model.name!r}")
    limits.check_id("request_id", raw.request_id)


def chat_options(add_generation_prompt: bool, continue_final_message: bool,
                 template_kwargs: Mapping[str, object] | None) -> dict:
    """The checked keyword arguments of a render beyond the messages, tools and cue (both
    transports and `/tokenize`): vLLM's rules, the two endings exclusive."""
    if continue_final_message and add_generation_prompt:
        raise ValidationError("continue_final_message", "cannot be set with add_generation_prompt "
                              "(set add_generation_prompt to false to continue the last message)")
    return {"continue_final_message": continue_final_message,
            "template_kwargs": limits.check_chat_template_kwargs(dict(template_kwargs or {}))}


def _prompt_ids(
    raw: RawGenerateRequest, model: ModelLimits, tokenize: Callable[[str], list[int]], render_chat
) -> tuple[list[int], str]:
    if raw.chat_messages is not None:
        if not raw.chat_messages:
            raise ValidationError("messages", "at least one message is required")
        if render_chat is None:
            raise ValidationError("messages", "chat prompts are not supported here")
        limits.check_messages(raw.chat_messages, model.max_model_len)
        tools = [dict(t) for t in raw.chat_tools] if raw.chat_tools else None
        options = chat_options(raw.add_generation_prompt, raw.continue_final_message, raw.chat_template_kwargs)
        return render_chat([dict(m) for m in raw.chat_messages], raw.add_generation_prompt, tools, **options), \
            "messages"
    if raw.prompt_token_ids is not None:
        return list(raw.prompt_token_ids), "prompt.token_ids"
    if raw.prompt_text is not None:
        limits.check_prompt_text(raw.prompt_text, model.max_model_len)
        return (tokenize(raw.prompt_text) if raw.prompt_text else []), "prompt.text"
    raise ValidationError("prompt", "set prompt.text or prompt.token_ids")
