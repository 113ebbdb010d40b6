"""Mistral's tool calls (Mistral-7B-Instruct-v0.3, Mistral-Nemo, Mistral-Small): content,
then the `[TOOL_CALLS]` token and a JSON array of `{"name": ..., "arguments": {...}}`
objects. Output without the token, or whose array is malformed, is content."""

from __future__ import annotations

from gateway.tool_parsers.base import Parsed, json_call_array, partial_tag

TOOL_CALLS = "[TOOL_CALLS]"


def parse(text: str, final: bool) -> Parsed:
    start = text.find(TOOL_CALLS)
    if start < 0:
        return Parsed(text if final else text[:len(text) - partial_tag(text, TOOL_CALLS)].rstrip())
    content = text[:start].rstrip()
    calls = json_call_array(text[start + len(TOOL_CALLS):], final)
    if calls is None:
        return Parsed(text)
    return Parsed(content, calls)
