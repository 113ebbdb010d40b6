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

Structured outputs and enforced tool calls apply to the answer only: `after_reasoning` gates
the constraint on the token ids of `</think>` (`StructuredOutput.start_after`), so the worker
leaves the reasoning free and enforces the grammar from the token after the block's end.
A prompt that already closed the block (Qwen3's template with `enable_thinking: false`
renders an empty `<think></think>`) is not gated: the grammar applies from the first token.
As in vLLM, output that never closes the block is never constrained (a `qwen3` model that
writes no `<think>` at all included).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

from gateway.tool_parsers.base import partial_tag
from stepahead.plan import StructuredOutput

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


def _last(ids: tuple[int, ...], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `ids` (-1: nowhere)."""
    n = len(marker)
    for i in range(len(ids) - n, -1, -1):
        if ids[i:i + n] == marker:
            return i
    return -1


def after_reasoning(structured: StructuredOutput, prompt_ids: tuple[int, ...], open_ids: tuple[int, ...],
                    close_ids: tuple[int, ...]) -> StructuredOutput:
    """`structured`, applied only once the output closed its reasoning block (`close_ids`),
    unless the prompt already closed it (its last `</think>` after its last `<think>`)."""
    if structured.start_after or _last(prompt_ids, close_ids) > _last(prompt_ids, open_ids):
        return structured
    return dataclasses.replace(structured, start_after=close_ids)
