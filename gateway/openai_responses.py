"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: the request becomes a
`ChatCompletionRequest` (same validation, chat template, tools, parsers, `Generation`), and
`ResponsesFormat` turns the chat output into a `response` object or its stream events.
Pure domain code. Supported: `input` as text or a list of messages (text content),
`function_call` and `function_call_output` items, `instructions`, function `tools`,
`tool_choice`, `max_output_tokens`, sampling, `stream`; stored state (`previous_response_id`,
`store: true`, `background`) is not kept and is refused.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.chat_output import ChatParsing
from gateway.generation import ChoiceOutput
from gateway.openai_format import ChatFormat
from gateway.openai_protocol import ChatCompletionRequest
from gateway.validation import ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(_Strict):
    """A message (`type` "message" or absent), a `function_call` or a `function_call_output`."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: str | None = None
    content: str | list[InputText] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    user: str | None = None


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion a Responses request is (ValidationError naming the field)."""
    if body.previous_response_id is not None:
        raise ValidationError("previous_response_id", "responses are not stored; send the whole conversation")
    if body.store:
        raise ValidationError("store", "responses are not stored (set store: false)")
    if body.background:
        raise ValidationError("background", "is not supported")
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        if item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ValidationError(f"input[{i}]", "a function_call needs call_id, name and arguments")
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise ValidationError(f"input[{i}]", "a function_call_output needs call_id and output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            if item.role is None:
                raise ValidationError(f"input[{i}].role", "is required")
            content = item.content if isinstance(item.content, str) or item.content is None else \
                "".join(part.text for part in item.content)
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": content})
    tool_choice = body.tool_choice
    if isinstance(tool_choice, dict):  # {"type": "function", "name": ...}
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    chat = {"model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "stream": body.stream,
            "parallel_tool_calls": body.parallel_tool_calls, "tool_choice": tool_choice,
            "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                      for t in body.tools] if body.tools else None}
    return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})


class ResponsesFormat:
    """A chat choice's output as a `response` (one choice: the Responses API has no `n`)."""

    def __init__(self, response_id: str, model: str, parsing: ChatParsing, max_output_tokens: int | None) -> None:
        self.id = response_id
        self.chat = ChatFormat(response_id, model, 1, parsing=parsing)
        self.model = model
        self.created = int(time.time())
        self.max_output_tokens = max_output_tokens
        self._seq = 0
        self._started = False
        self._text: str | None = None  # the open message item's text (streaming)
        self._calls: dict[int, dict] = {}  # the function_call items streamed, by call index
        self._items: list[dict] = []  # output items, in stream order

    def accumulate(self, choice: ChoiceOutput) -> None:
        self.chat.accumulate(choice)

    def full(self) -> dict:
        body = self.chat.full()
        choice = body["choices"][0]
        message = choice["message"]
        items = []
        if message.get("content"):
            items.append(_message_item(message["content"]))
        for call in message.get("tool_calls", ()):
            items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
        return self._response(items, choice["finish_reason"])

    def _response(self, items: list[dict], finish_reason: str | None) -> dict:
        usage = self.chat.usage()
        incomplete = finish_reason == "length"
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": items, "error": None, "instructions": None, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
                "usage": {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]}}

    def _event(self, kind: str, **fields) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def chunk(self, choice: ChoiceOutput) -> list[dict]:
        """The stream events of one output: `response.created` first, `response.completed` last."""
        events = []
        if not self._started:
            self._started = True
            shell = self._response([], None) | {"status": "in_progress", "usage": None}
            events.append(self._event("response.created", response=shell))
        finish = None
        for chunk in self.chat.chunk(choice):
            entry = chunk["choices"][0]
            finish = entry["finish_reason"] or finish
            delta = entry["delta"]
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls", ()):
                events += self._call_delta(call)
        if choice.output.finished:
            events += self._close_text()
            for index in sorted(self._calls):
                item = self._calls[index]
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=item["index"], arguments=item["arguments"]))
                events.append(self._event("response.output_item.done", output_index=item["index"],
                                          item=_call_item(item["call_id"], item["name"], item["arguments"], item["id"])))
            events.append(self._event("response.completed", response=self._response(self._items, finish)))
        return events

    def _text_delta(self, text: str) -> list[dict]:
        events = []
        if self._text is None:
            self._text = ""
            self._items.append(_message_item("", status="in_progress"))
            item = self._items[-1]
            events.append(self._event("response.output_item.added", output_index=len(self._items) - 1,
                                      item=item | {"content": []}))
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self._items) - 1, content_index=0, part=_text_part("")))
        self._text += text
        index = next(i for i, it in enumerate(self._items) if it["type"] == "message")
        item = self._items[index]
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _close_text(self) -> list[dict]:
        if self._text is None:
            return []
        index = next(i for i, it in enumerate(self._items) if it["type"] == "message")
        self._items[index] = item = _message_item(self._text, item_id=self._items[index]["id"])
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=self._text, logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=_text_part(self._text)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_delta(self, call: dict) -> list[dict]:
        events = []
        if "id" in call:
            item = _call_item(call["id"], call["function"]["name"], "", status="in_progress")
            self._items.append(item)
            self._calls[call["index"]] = {"id": item["id"], "call_id": call["id"], "name": call["function"]["name"],
                                          "arguments": "", "index": len(self._items) - 1}
            events.append(self._event("response.output_item.added", output_index=len(self._items) - 1, item=item))
        state = self._calls[call["index"]]
        piece = call["function"]["arguments"]
        state["arguments"] += piece
        self._items[state["index"]] = _call_item(state["call_id"], state["name"], state["arguments"], state["id"])
        if piece:
            events.append(self._event("response.function_call_arguments.delta", item_id=state["id"],
                                      output_index=state["index"], delta=piece))
        return events


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _call_item(call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
