"""Hermes / Qwen format (NousResearch's Hermes-2-Pro, Qwen2.5, Qwen3 chat templates): each
call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
`</tool_call>`; text outside the tags is content. A block that is not such an object stays
in the content as written."""

from __future__ import annotations

from gateway.tool_parsers.base import Parsed, ParsedCall, json_call, partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse(text: str, final: bool) -> Parsed:
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - partial_tag(tail, OPEN)])
            break
        content.append(text[pos:start])
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        if end < 0 and not final:  # a block still being written
            call, _ = json_call(body[:len(body) - partial_tag(body, CLOSE)], final=False)
            if call is not None:
                calls.append(call)
            break
        call, used = json_call(body, final=True)
        if call is None or body[used:].strip():
            content.append(text[start:] if end < 0 else text[start:end + len(CLOSE)])
        else:
            calls.append(call)
        if end < 0:
            break
        pos = end + len(CLOSE)
    return Parsed(_joined(content, calls, final), tuple(calls))


def _joined(content: list[str], calls: list[ParsedCall], final: bool) -> str:
    """The content around the calls. Blanks at its end are held back mid-stream (a call may
    follow them) and dropped once there are calls."""
    text = "".join(content)
    return text if final and not calls else text.rstrip()
