"""What every tool-call parser shares: the parsed view of a model's text, and the streamer
that turns successive views into OpenAI's deltas.

A parser is a pure function of the text generated so far: `parse(text, final)` returns the
content and the calls it can vouch for. With `final=False` (mid-stream) it holds back what
more text could still change (a tag cut in half, a call whose name is not complete, the
closing brace that may end the call rather than its arguments), so each view extends the
previous one; with `final=True` it decides, and output that is not a well-formed call of its
format is plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as the model wrote it (a prefix of it mid-stream)


@dataclass(frozen=True)
class Parsed:
    content: str = ""
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of call `index`: its id and name the first time, then argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallStream:
    """Successive `Parsed` views of one choice's text in, the deltas between them out.

    Each view is expected to extend the previous one (the parsers hold back what could
    change); where a final view does not (a call whose name was streamed turned out
    malformed), what was sent stands and only its extensions are sent."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def update(self, view: Parsed) -> tuple[str, list[ToolCallDelta]]:
        content = view.content[len(self.content):] if view.content.startswith(self.content) else ""
        self.content += content
        deltas = []
        for i, call in enumerate(view.calls):
            if i < len(self.calls):
                sent = self.calls[i]
                if call.name != sent.name or not call.arguments.startswith(sent.arguments):
                    continue
                more = call.arguments[len(sent.arguments):]
                if more:
                    deltas.append(ToolCallDelta(i, more))
                    self.calls[i] = call
            elif i == len(self.calls):
                self.calls.append(call)
                self.ids.append(new_call_id())
                deltas.append(ToolCallDelta(i, call.arguments, self.ids[i], call.name))
        return content, deltas


def partial_tag(text: str, *tags: str) -> int:
    """How many characters at the end of `text` could begin one of `tags` (held back mid-stream)."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def json_call(text: str, final: bool) -> tuple[ParsedCall | None, int]:
    """One `{"name": ..., "arguments"|"parameters": {...}}` object at the start of `text`:
    (the call, the index after it). Mid-stream the call may be partial (its arguments a
    prefix, trailing braces and blanks held back); None when there is no call (yet): final,
    that means `text` does not start with a well-formed call."""
    try:
        obj, end = _DECODER.raw_decode(text, len(text) - len(text.lstrip()))
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        return _complete_call(text, obj, end), end
    if final:
        return None, 0
    head = _CALL_HEAD.match(text)
    if head is None:
        return None, 0
    rest = text[head.end():]
    return ParsedCall(json.loads(head.group(1)), rest.rstrip(" \t\r\n}")), len(text)


def _complete_call(text: str, obj: dict, end: int) -> ParsedCall | None:
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or not isinstance(args, dict) or set(obj) - {"name", "arguments", "parameters"}:
        return None
    head = _CALL_HEAD.match(text)
    if head is not None:  # the arguments as written: what was streamed extends to exactly this
        _, args_end = _DECODER.raw_decode(text, head.end())
        return ParsedCall(name, text[head.end():args_end])
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def json_call_array(text: str, final: bool) -> tuple[ParsedCall, ...] | None:
    """A JSON array of calls (`json_call` objects) making up all of `text`: the calls (mid-stream
    those so far, the last maybe partial); final, None when `text` is not such an array."""
    body = text.lstrip()
    if not body:
        return None if final else ()
    if not body.startswith("["):
        return None if final else ()
    calls: list[ParsedCall] = []
    rest = body[1:].lstrip()
    while True:
        if rest.startswith("]") and (calls or not final):
            return tuple(calls) if not rest[1:].strip() else (None if final else tuple(calls))
        call, used = json_call(rest, final)
        if call is None:
            return None if final else tuple(calls)
        calls.append(call)
        after = rest[used:].lstrip()
        if not after:
            return None if final else tuple(calls)
        if after.startswith(","):
            rest = after[1:].lstrip()
            continue
        if not after.startswith("]"):
            return None if final else tuple(calls)
        rest = after
