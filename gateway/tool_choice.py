"""`tool_choice: "required"` and a named function, enforced: the tools' parameter schemas as
one JSON schema for the structured-output path (xgrammar on the worker), and the constrained
output read back as calls. Pure domain code.

- named function: the output is that function's arguments object (its `parameters` schema).
- `required`: the output is a JSON array of `{"name": <a tool's name>, "parameters": <its
  schema>}` objects, at least one (exactly one when `parallel_tool_calls` is false).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import NamedTuple

from gateway.tool_parsers.base import Parsed, ParsedCall, json_call_array
from stepahead.limits import LimitError as ValidationError
from stepahead.plan import SamplingParams, StructuredKind, StructuredOutput

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


    def constrain(self, sampling: SamplingParams, field: str = "tool_choice") -> SamplingParams:
        """`sampling` with the output's schema set to the calls' (a request that sets its own
        structured output as well is refused)."""
        if sampling.structured is not None:
            raise ValidationError(field, f"{self._shown()} sets the output's schema: leave out the request's own "
                                         "structured output (response_format / structured_outputs)")
        return dataclasses.replace(
            sampling, structured=StructuredOutput(StructuredKind.JSON_SCHEMA, spec=self.schema_json()))

    def _shown(self) -> str:
        return f"function {self.name!r}" if self.name is not None else "'required'"


class ToolFields(NamedTuple):
    """The request fields a refusal names (the HTTP and gRPC spellings differ)."""

    choice: str = "tool_choice"
    function: str = "tool_choice.function.name"
    tools: str = "tools"


class ToolMode(enum.Enum):
    """`tool_choice` other than a named function."""

    NONE = "none"  # text only; calls the model writes are not parsed
    AUTO = "auto"  # the model decides; calls are read by --tool-call-parser
    REQUIRED = "required"  # one or more calls, enforced


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and `tool_choice` (the HTTP and gRPC forms map onto this).

    `function` set: call that function. Else `mode`, None meaning AUTO with tools, NONE
    without (OpenAI's default)."""

    tools: tuple[ToolSpec, ...] = ()
    mode: ToolMode | None = None
    function: str | None = None
    parallel: bool = True

    @property
    def effective_mode(self) -> ToolMode | None:
        """None for a named function."""
        if self.function is not None:
            return None
        if self.mode is not None:
            return self.mode
        return ToolMode.AUTO if self.tools else ToolMode.NONE

    def forced(self, fields: ToolFields = ToolFields()) -> ForcedTools | None:
        """`required` or a named function: the tools whose schema the output must follow."""
        mode = self.effective_mode
        if mode in (ToolMode.NONE, ToolMode.AUTO):
            return None
        shown = f"function {self.function!r}" if self.function is not None else repr(mode.value)
        if not self.tools:
            raise ValidationError(fields.choice, f"{shown} needs tools")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValidationError(fields.tools, "function names must be unique")
        if self.function is not None and self.function not in names:
            raise ValidationError(fields.function, f"{self.function!r} is not one of the tools")
        return ForcedTools(self.tools, self.function, self.parallel)


def call_arguments(text: str, field: str) -> dict:
    """A call's `arguments` JSON text from a client, as chat templates take it (an object)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValidationError(field, f"is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValidationError(field, "must be a JSON object")
    return value
