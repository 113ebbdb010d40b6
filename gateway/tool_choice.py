"""`tool_choice: "required"` and a named function, enforced: the tools' parameter schemas as
one JSON schema for the structured-output path (xgrammar on the worker), and the constrained
output read back as calls. Pure domain code.

- named function: the output is that function's arguments object (its `parameters` schema).
- `required`: the output is a JSON array of `{"name": <a tool's name>, "parameters": <its
  schema>}` objects, at least one (exactly one when `parallel_tool_calls` is false).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.tool_parsers.base import Parsed, ParsedCall, json_call_array

ANY_OBJECT = {"type": "object"}  # a function declared without `parameters`


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict | None = None

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else ANY_OBJECT


@dataclass(frozen=True)
class ForcedTools:
    """What the constrained output is: one named function's arguments, or (`name` None) an
    array of calls of any of `tools`."""

    tools: tuple[ToolSpec, ...]
    name: str | None = None
    parallel: bool = True

    def schema(self) -> dict:
        if self.name is not None:
            return next(t.schema for t in self.tools if t.name == self.name)
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": t.schema},
                           "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]}
        array = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return array

    def schema_json(self) -> str:
        return json.dumps(self.schema())

    def parse(self, text: str, final: bool) -> Parsed:
        """The constrained output as calls (`tool_parsers` contract); output that is not valid
        (cut short by max_tokens) is content."""
        if self.name is not None:
            args = text.strip()
            if final:
                try:
                    valid = isinstance(json.loads(args), dict)
                except ValueError:
                    valid = False
                return Parsed(calls=(ParsedCall(self.name, args),)) if valid else Parsed(text)
            return Parsed(calls=(ParsedCall(self.name, args),)) if args else Parsed()
        calls = json_call_array(text, final)
        return Parsed(text) if calls is None else Parsed(calls=calls)


def forced(tools: Sequence[ToolSpec], choice: str | None, parallel: bool) -> ForcedTools:
    """`choice`: a function's name, or None for `required`."""
    return ForcedTools(tuple(tools), choice, parallel)
