"""Mistral's tool calls (Mistral-7B-Instruct-v0.3, Mistral-Nemo, Mistral-Small): content,
then the `[TOOL_CALLS]` token and a JSON array of `{"name": ..., "arguments": {...}}`
objects. Output without the token, or whose array is malformed, is content."""

from __future__ import annotations

from gateway.tool_parsers.base import Parsed, ParsedCall, json_call, partial_tag

TOOL_CALLS = "[TOOL_CALLS]"


def parse(text: str, final: bool) -> Parsed:
    start = text.find(TOOL_CALLS)
    if start < 0:
        return Parsed(text if final else text[:len(text) - partial_tag(text, TOOL_CALLS)].rstrip())
    content = text[:start].rstrip()
    body = text[start + len(TOOL_CALLS):].lstrip()
    calls: list[ParsedCall] = []
    if not body:
        return Parsed(content) if not final else Parsed(text)
    if not body.startswith("["):
        return Parsed(text) if final else Parsed(content)
    pos = 1
    while True:
        rest = body[pos:].lstrip()
        if final and rest.startswith("]") and calls and not rest[1:].strip():
            return Parsed(content, tuple(calls))
        call, used = json_call(rest, final)
        if call is None:
            return Parsed(text) if final else Parsed(content, tuple(calls))
        calls.append(call)
        after = rest[used:].lstrip()
        if not final and not after:
            return Parsed(content, tuple(calls))
        if after.startswith(","):
            pos = len(body) - len(after) + 1
            continue
        if after.startswith("]") and not after[1:].strip():
            return Parsed(content, tuple(calls))
        return Parsed(text) if final else Parsed(content, tuple(calls))
