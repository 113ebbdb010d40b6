"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`): each reads one format's
documented syntax out of the model's text (see `base.py` for the contract)."""

from __future__ import annotations

import enum
from collections.abc import Callable

from gateway.tool_parsers import hermes, llama3_json, mistral, pythonic
from gateway.tool_parsers.base import CallStream, Parsed, ParsedCall, ToolCallDelta

__all__ = ["CallStream", "PARSERS", "Parsed", "ParsedCall", "ToolCallDelta", "ToolCallParser"]


class ToolCallParser(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    PYTHONIC = "pythonic"


PARSERS: dict[ToolCallParser, Callable[[str, bool], Parsed]] = {
    ToolCallParser.HERMES: hermes.parse,
    ToolCallParser.LLAMA3_JSON: llama3_json.parse,
    ToolCallParser.MISTRAL: mistral.parse,
    ToolCallParser.PYTHONIC: pythonic.parse,
}
