"""Tool calling over the gateway's HTTP API with the official `openai` client, against real
daemons: `required` and a named function are enforced (the arguments parse and validate
against the tool's schema whatever the model), streamed or not; `auto` without a
`--tool-call-parser` is refused naming the field. The built-in real model with async
scheduling and speculation: `test_real_model_tools.py`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.openai_helpers import USER

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """The calls a client assembles from `delta.tool_calls` (OpenAI's rules: id, type and name
    on a call's first piece, then arguments by index), the finish reason, the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_returns_arguments_that_validate(openai_client, stream):
    kwargs = dict(model="tiny", messages=USER, max_tokens=80, temperature=1.0, seed=7, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        out = openai_client.chat.completions.create(**kwargs)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and not message.content
        check_calls([(c.function.name, c.function.arguments) for c in message.tool_calls], {"get_weather"})
        assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
        return
    calls, finish, content = streamed_calls(openai_client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == ""
    check_calls([(c["name"], c["arguments"]) for c in calls], {"get_weather"})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_calls_of_the_tools_that_validate(openai_client, stream, parallel):
    kwargs = dict(model="tiny", messages=USER, max_tokens=160, temperature=1.0, seed=11, tools=[WEATHER, TIME],
                  tool_choice="required", parallel_tool_calls=parallel)
    if not stream:
        out = openai_client.chat.completions.create(**kwargs)
        calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
        assert out.choices[0].finish_reason == "tool_calls"
    else:
        got, finish, _ = streamed_calls(openai_client.chat.completions.create(stream=True, **kwargs))
        calls = [(c["name"], c["arguments"]) for c in got]
        assert finish == "tool_calls"
    check_calls(calls, {"get_weather", "get_time"})
    if not parallel:
        assert len(calls) == 1


def test_streamed_and_whole_calls_are_the_same_text(openai_client):
    kwargs = dict(model="tiny", messages=USER, max_tokens=160, temperature=1.0, seed=3, tools=[WEATHER, TIME],
                  tool_choice="required")
    whole = openai_client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    streamed, _, _ = streamed_calls(openai_client.chat.completions.create(stream=True, **kwargs))
    assert [(c.function.name, c.function.arguments) for c in whole] == \
        [(c["name"], c["arguments"]) for c in streamed]


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # auto (the default with tools) without --tool-call-parser
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools.0.function.name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_name_the_field(openai_client, body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model="tiny", messages=body.pop("messages", USER), max_tokens=4,
                                              extra_body=body)
    assert refused.value.body["param"] == param, refused.value.body


def test_tool_choice_none_and_a_tool_history_give_plain_content(openai_client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = openai_client.chat.completions.create(model="tiny", messages=history, max_tokens=6, temperature=0,
                                                tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
