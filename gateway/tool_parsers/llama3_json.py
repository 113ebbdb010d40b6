"""Llama 3.1 / 3.2 JSON tool calls (Meta's "JSON based tool calling"): the whole message is
one or more `{"name": ..., "parameters": {...}}` objects separated by `;`, optionally after
`<|python_tag|>`. A message that does not start with an object is content."""

from __future__ import annotations

from gateway.tool_parsers.base import Parsed, ParsedCall, json_call, partial_tag

PYTHON_TAG = "<|python_tag|>"


def parse(text: str, final: bool) -> Parsed:
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    elif not final and partial_tag(body, PYTHON_TAG) == len(body):
        return Parsed()  # the tag itself, cut short (or nothing yet)
    if not body and not final:
        return Parsed()
    if not body.startswith("{"):
        return Parsed(text)
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(body):
        call, used = json_call(body[pos:], final)
        if call is None:
            return Parsed() if not final else Parsed(text)
        calls.append(call)
        if pos + used >= len(body):
            break
        pos += used
        rest = body[pos:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return Parsed(text) if final else Parsed(calls=tuple(calls))
        pos = len(body) - len(rest[1:].lstrip())
    return Parsed(calls=tuple(calls))
