"""Reasoning parsers (`--reasoning-parser`): a reasoning model's `<think>…</think>` block comes
back as `reasoning_content`, apart from the answer's `content`.

Like the tool-call parsers, a parser is a pure function of the text generated so far:
`split(text, final)` gives (reasoning, the rest); mid-stream a `</think>` cut in half is held
back, so each split extends the previous one.

- `deepseek_r1`: the template opens the block in the prompt, so the output starts inside it
  (a leading `<think>` is allowed); everything up to `</think>` is reasoning, and output that
  never closes the block is all reasoning.
- `qwen3`: reasoning only when the output opens with `<think>` (Qwen3 with thinking off
  writes none); a block never closed is reasoning, as with DeepSeek-R1.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from gateway.tool_parsers.base import partial_tag

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser(enum.Enum):
    DEEPSEEK_R1 = "deepseek_r1"
    QWEN3 = "qwen3"


class Split(NamedTuple):
    reasoning: str
    content: str
    ended: bool  # the reasoning is over: what follows is the answer


def split(kind: ReasoningParser, text: str, final: bool) -> Split:
    body = text.lstrip()
    if body.startswith(OPEN):
        body = body[len(OPEN):]
    elif not final and partial_tag(body, OPEN) == len(body) and body:
        return Split("", "", False)  # `<think` cut short
    elif kind is ReasoningParser.QWEN3 and (body or final):
        return Split("", text, True)
    end = body.find(CLOSE)
    if end >= 0:
        return Split(body[:end], body[end + len(CLOSE):].lstrip("\n") if final or body[end + len(CLOSE):].strip()
                     else "", True)
    return Split(body if final else body[:len(body) - partial_tag(body, CLOSE)], "", False)
