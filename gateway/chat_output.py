"""A chat choice's text split into what OpenAI returns apart: `reasoning_content` (the
reasoning parser), `content`, and `tool_calls` (the tool-call parser for `tool_choice: auto`,
or the enforced JSON of `required` / a named function). Pure domain code: text in, deltas out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from gateway import reasoning_parsers
from gateway.reasoning_parsers import ReasoningParser
from gateway.tool_choice import ForcedTools, ToolFields, ToolMode, ToolRequest
from gateway.tool_parsers import PARSERS, CallStream, Parsed, ToolCallDelta, ToolCallParser
from stepahead.limits import LimitError as ValidationError


@dataclass(frozen=True)
class ChatParsing:
    """How a request's output is read (all None: the text is the content, as it is)."""

    reasoning: ReasoningParser | None = None
    tool_parser: ToolCallParser | None = None  # tool_choice auto
    forced: ForcedTools | None = None  # tool_choice required or a named function

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tool_parser is None and self.forced is None


def chat_parsing(tools: ToolRequest, tool_parser: ToolCallParser | None, reasoning: ReasoningParser | None,
                 fields: ToolFields = ToolFields()) -> ChatParsing:
    """How a request's output is read: the server's parsers (`--tool-call-parser`,
    `--reasoning-parser`) and the request's tool choice."""
    if tools.effective_mode is ToolMode.AUTO and tools.tools:
        if tool_parser is None:
            raise ValidationError(fields.choice, '"auto" needs the server started with --tool-call-parser; '
                                         'use "required", a named function or "none"')
        return ChatParsing(reasoning, tool_parser, None)
    return ChatParsing(reasoning, None, tools.forced(fields))


class ChatDelta(NamedTuple):
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass
class ChatOutputParser:
    """One choice: feed its text pieces in order (`final` with the last), get the deltas."""

    parsing: ChatParsing
    text: str = ""
    reasoning: str = ""
    calls: CallStream = field(default_factory=CallStream)

    def feed(self, piece: str, final: bool) -> ChatDelta:
        self.text += piece
        answer = self.text
        reasoning = ""
        if self.parsing.reasoning is not None:
            split = reasoning_parsers.split(self.parsing.reasoning, self.text, final)
            reasoning, answer = split.reasoning, split.content
        more_reasoning = reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        self.reasoning += more_reasoning
        content, calls = self.calls.update(self._view(answer, final))
        return ChatDelta(more_reasoning, content, tuple(calls))

    def _view(self, answer: str, final: bool) -> Parsed:
        if self.parsing.forced is not None:
            return self.parsing.forced.parse(answer, final)
        if self.parsing.tool_parser is not None:
            return PARSERS[self.parsing.tool_parser](answer, final)
        return Parsed(answer)
