"""OpenAI response bodies (plain dicts: built per streamed token, so kept cheap).

`CompletionFormat` and `ChatFormat` turn the gateway's `ChoiceOutput`s into the
completions / chat completions objects and stream chunks, and accumulate the
non-streaming response. Pure domain code, no transport.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.chat_output import ChatOutputParser, ChatParsing
from gateway.generation import ChoiceOutput, SpecUsage
from gateway.tool_parsers import ToolCallDelta
from gateway.openai_logprobs import align_to_text, chat_logprobs, completion_logprobs, merge_completion_logprobs


def error_body(message: str, type_: str, param: str | None, code: int | str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)  # per output: a completions logprobs dict / chat content items
    spec: SpecUsage = SpecUsage()
    seen_prompt: bool = False  # the prompt's token counts were recorded from one of its events


class _Format:
    object_full = ""
    object_chunk = ""

    def __init__(self, response_id: str, model: str, n: int, logprobs: bool = False, prompts: int = 1) -> None:
        """`n` choices per prompt; `prompts` > 1 is a batched completions request, whose
        choice `i * n + j` is prompt i's choice j (OpenAI's and vLLM's order)."""
        self.logprobs = logprobs  # the request asked for logprobs (else the field is null)
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        self.choices = [_Choice() for _ in range(n * prompts)]
        self._prompt_tokens = [0] * prompts  # per prompt, from its choices' final events
        self._cached_tokens = [0] * prompts

    def _record(self, choice: ChoiceOutput) -> _Choice:
        state = self.choices[choice.index]
        out = choice.output
        state.num_tokens = out.num_output_tokens
        if out.finished or not state.seen_prompt:  # the first event (usage mid-stream), then the final counts
            state.seen_prompt = True
            prompt = choice.index // self.n
            self._prompt_tokens[prompt] = choice.num_prompt_tokens
            self._cached_tokens[prompt] = choice.num_cached_tokens
        if out.finished:
            state.finish_reason = out.finish_reason.value
            state.stop_reason = _stop_reason(out.stop_reason)
            state.spec = choice.spec
        return state

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        prompt = sum(self._prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens)},
            **self._spec_usage(),
        }

    def _spec_usage(self) -> dict:
        """Speculative decoding extras (stepahead's, absent when no draft was verified)."""
        spec = sum((c.spec for c in self.choices), SpecUsage())
        if not spec.draft_tokens:
            return {}
        return {"speculative_decoding": {
            "draft_tokens": spec.draft_tokens, "accepted_tokens": spec.accepted_tokens,
            "acceptance_rate": round(spec.acceptance_rate, 6),
            "mean_accepted_length": round(spec.mean_accepted_length, 6)}}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self) -> dict:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = self.usage()
        return body


def _stop_reason(value: str) -> str | int | None:
    if not value:
        return None
    return int(value) if value.isdigit() else value


class CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, response_id: str, model: str, n: int, echo_texts: Sequence[str | None] = (None,),
                 logprobs: bool = False, echo_only: bool = False) -> None:
        """`echo_texts`: per prompt (one, or a batch's), the text `echo` puts before its
        choices' output, or None without echo."""
        super().__init__(response_id, model, n, logprobs, prompts=len(echo_texts))
        self._echo_only = echo_only  # echo with max_tokens 0: the generated token is left out
        self._echo_texts = [text or "" for text in echo_texts for _ in range(n)]  # per choice
        self._echo_pending = [bool(text) for text in self._echo_texts]

    def _text(self, choice: ChoiceOutput) -> str:
        i = choice.index
        echo = self._echo_texts[i] if self._echo_pending[i] else ""
        self._echo_pending[i] = False
        return echo + ("" if self._echo_only else choice.output.text)

    def _logprobs(self, choice: ChoiceOutput) -> dict | None:
        """This output's logprobs object: the prompt's first (echo), then the generated tokens'
        (their text offsets count from the start of the echoed prompt)."""
        if not self.logprobs:
            return None
        out = choice.output
        echo = self._echo_texts[choice.index]
        parts = [completion_logprobs(align_to_text(out.prompt_logprobs, echo))] if out.prompt_logprobs else []
        if not self._echo_only:
            parts.append(completion_logprobs(out.logprobs, len(echo)))
        return merge_completion_logprobs(parts)

    def accumulate(self, choice: ChoiceOutput) -> None:
        state = self._record(choice)
        state.text.append(self._text(choice))
        if self.logprobs:
            state.logprobs.append(self._logprobs(choice))

    def chunk(self, choice: ChoiceOutput) -> list[dict]:
        """The chunks for one output (none when it carries no text, no logprobs and does not finish)."""
        state = self._record(choice)
        text = self._text(choice)
        logprobs = self._logprobs(choice)
        if not text and not choice.output.finished and not (logprobs and logprobs["tokens"]):
            return []
        entry = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": state.finish_reason}
        if choice.output.finished:
            entry["stop_reason"] = state.stop_reason
        return [self._envelope(self.object_chunk, [entry])]

    def full(self) -> dict:
        choices = [
            {"index": i, "text": "".join(c.text),
             "logprobs": merge_completion_logprobs(c.logprobs) if self.logprobs else None,
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for i, c in enumerate(self.choices)
        ]
        body = self._envelope(self.object_full, choices)
        body["usage"] = self.usage()
        return body


class ChatFormat(_Format):
    """With a `ChatParsing` that is not plain, each choice's text goes through a
    `ChatOutputParser`: `reasoning_content`, `content` and `tool_calls` (OpenAI's deltas when
    streaming: a call's id, type and name first, then its arguments in pieces)."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, n: int, logprobs: bool = False,
                 parsing: ChatParsing = ChatParsing()) -> None:
        super().__init__(response_id, model, n, logprobs)
        self._role_sent = [False] * n
        self.parsing = parsing
        self._parsers = [ChatOutputParser(parsing) for _ in range(n)]
        self._made_calls = [False] * n

    def accumulate(self, choice: ChoiceOutput) -> None:
        state = self._record(choice)
        state.text.append(choice.output.text)
        state.logprobs += chat_logprobs(choice.output.logprobs)

    def chunk(self, choice: ChoiceOutput) -> list[dict]:
        """The chunks for one output: the `role` delta first, once per choice."""
        state = self._record(choice)
        out = choice.output
        chunks = []
        if not self._role_sent[choice.index]:
            self._role_sent[choice.index] = True
            chunks.append(self._delta(choice.index, {"role": "assistant", "content": ""}, None))
        logprobs = {"content": chat_logprobs(out.logprobs)} if self.logprobs else None
        delta = self._delta_fields(choice.index, out.text, out.finished)
        if delta or (logprobs and logprobs["content"]):
            chunks.append(self._delta(choice.index, delta or {"content": ""}, None, logprobs=logprobs))
        if out.finished:
            reason = _finish_reason(state.finish_reason, self._made_calls[choice.index])
            chunks.append(self._delta(choice.index, {}, reason, state.stop_reason))
        return chunks

    def _delta_fields(self, index: int, text: str, final: bool) -> dict:
        if self.parsing.plain:
            return {"content": text} if text else {}
        parsed = self._parsers[index].feed(text, final)
        delta: dict = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            self._made_calls[index] = True
            delta["tool_calls"] = [_call_delta(d) for d in parsed.tool_calls]
        return delta

    def _delta(self, index: int, delta: dict, finish_reason: str | None, stop_reason=None, logprobs=None) -> dict:
        entry = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            entry["stop_reason"] = stop_reason
        return self._envelope(self.object_chunk, [entry])

    def message(self, text: str) -> tuple[dict, bool]:
        """One choice's whole text as an assistant message (and whether it holds calls)."""
        if self.parsing.plain:
            return {"role": "assistant", "content": text}, False
        parser = ChatOutputParser(self.parsing)
        parsed = parser.feed(text, True)
        message: dict = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
        if self.parsing.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning or None
        calls = [{"id": parser.calls.ids[i], "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}}
                 for i, call in enumerate(parser.calls.calls)]
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def full(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            message, made_calls = self.message("".join(c.text))
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": c.logprobs} if self.logprobs else None,
                            "finish_reason": _finish_reason(c.finish_reason, made_calls),
                            "stop_reason": c.stop_reason})
        body = self._envelope(self.object_full, choices)
        body["usage"] = self.usage()
        return body


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's `tool_calls` for a choice that ended on its own after making calls."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def _call_delta(d: ToolCallDelta) -> dict:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
