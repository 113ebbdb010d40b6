"""Tools over the public gRPC API, without daemons: a `Chat` with tools, a tool history and a
tool choice maps onto exactly what the same chat over HTTP does (messages and tools as the
chat template takes them, the enforced schema, how the output is read), and a malformed one
is refused naming the proto's field."""

from __future__ import annotations

import json

import pytest

from gateway.openai_protocol import ChatCompletionRequest, chat_parsing, chat_to_raw
from gateway.server import raw_from_proto
from gateway.tool_parsers import ToolCallParser
from gateway.validation import ValidationError
from stepahead.v1 import common_pb2, generation_pb2
from tests.unit.test_chat_tools import ARGS, HISTORY, WEATHER

TIME = {"type": "function", "function": {"name": "get_time"}}  # no description, no parameters


def proto_tool(tool: dict) -> generation_pb2.Tool:
    f = tool["function"]
    return generation_pb2.Tool(name=f["name"], description=f.get("description", ""),
                               parameters_json=json.dumps(f["parameters"]) if "parameters" in f else "")


def proto_chat(messages: list[dict], tools: list[dict], **choice) -> generation_pb2.GenerateRequest:
    pb = []
    for m in messages:
        calls = [generation_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in m.get("tool_calls", ())]
        pb.append(generation_pb2.ChatMessage(role=m["role"], content=m["content"] or "", tool_calls=calls,
                                             tool_call_id=m.get("tool_call_id", "")))
    chat = generation_pb2.Chat(messages=pb, tools=[proto_tool(t) for t in tools], **choice)
    return generation_pb2.GenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(max_tokens=8))


@pytest.mark.parametrize("http_choice, grpc_choice", [
    ("none", {"tool_choice": generation_pb2.ToolChoice(mode=generation_pb2.TOOL_MODE_NONE)}),
    ("required", {"tool_choice": generation_pb2.ToolChoice(mode=generation_pb2.TOOL_MODE_REQUIRED)}),
    ({"type": "function", "function": {"name": "get_weather"}},
     {"tool_choice": generation_pb2.ToolChoice(function="get_weather")}),
    (None, {}),  # unset: auto with tools, read by the parser
])
def test_a_grpc_chat_with_tools_maps_as_the_same_http_chat(http_choice, grpc_choice):
    body = {"messages": HISTORY, "tools": [WEATHER, TIME], "max_tokens": 8}
    if http_choice is not None:
        body["tool_choice"] = http_choice
    http = ChatCompletionRequest.model_validate(body)
    want_raw = chat_to_raw(http, 0)
    want_parsing = chat_parsing(http, ToolCallParser.HERMES, None)

    raw, parsing = raw_from_proto(proto_chat(HISTORY, [WEATHER, TIME], **grpc_choice), ToolCallParser.HERMES)
    assert list(raw.chat_messages) == list(want_raw.chat_messages)
    assert raw.chat_messages[1]["tool_calls"][0]["function"]["arguments"] == json.loads(ARGS)
    assert raw.chat_messages[2]["tool_call_id"] == "call_1"
    assert list(raw.chat_tools) == list(want_raw.chat_tools) == [WEATHER, TIME]
    assert raw.sampling.structured == want_raw.sampling.structured
    assert parsing == want_parsing


def test_parallel_tool_calls_false_allows_one_call():
    request = proto_chat(HISTORY[:1], [WEATHER, TIME], parallel_tool_calls=False,
                         tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_MODE_REQUIRED))
    raw, _ = raw_from_proto(request)
    assert json.loads(raw.sampling.structured.spec)["maxItems"] == 1


def test_a_text_prompt_is_read_plain():
    raw, parsing = raw_from_proto(generation_pb2.GenerateRequest(text="hi"), ToolCallParser.HERMES)
    assert parsing.plain and raw.chat_tools is None


REQUIRED = {"tool_choice": generation_pb2.ToolChoice(mode=generation_pb2.TOOL_MODE_REQUIRED)}


@pytest.mark.parametrize("messages, tools, choice, field", [
    (HISTORY[:1], [WEATHER], {}, "chat.tool_choice"),  # auto without --tool-call-parser
    (HISTORY[:1], [], REQUIRED, "chat.tool_choice"),
    (HISTORY[:1], [WEATHER], {"tool_choice": generation_pb2.ToolChoice(function="nope")}, "chat.tool_choice.function"),
    (HISTORY[:1], [WEATHER, WEATHER], REQUIRED, "chat.tools"),
    (HISTORY[:1], [{"type": "function", "function": {"name": "bad name!"}}], REQUIRED, "chat.tools[0].name"),
    (HISTORY[:1], [{"type": "function", "function": {"name": ""}}], REQUIRED, "chat.tools[0].name"),
    (HISTORY[:1], [WEATHER] * 129, REQUIRED, "chat.tools"),
    (HISTORY[:1], [{"type": "function", "function": {"name": "f", "parameters": [1]}}], REQUIRED,
     "chat.tools[0].parameters_json"),
    (HISTORY[:1], [WEATHER], {"tool_choice": generation_pb2.ToolChoice(mode=99)}, "chat.tool_choice"),
])
def test_bad_tools_name_the_proto_field(messages, tools, choice, field):
    with pytest.raises(ValidationError) as refused:
        raw_from_proto(proto_chat(messages, tools, **choice))
    assert refused.value.field == field, str(refused.value)


def test_bad_call_arguments_in_the_history_name_the_field():
    history = json.loads(json.dumps(HISTORY))
    history[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ValidationError) as refused:
        raw_from_proto(proto_chat(history, [WEATHER]))
    assert refused.value.field == "chat.messages[1].tool_calls[0].arguments"


def test_bad_parameters_json_text_names_the_field():
    tool = generation_pb2.Tool(name="f", parameters_json="{oops")
    request = generation_pb2.GenerateRequest(chat=generation_pb2.Chat(
        messages=[generation_pb2.ChatMessage(role="user", content="x")], tools=[tool], **REQUIRED))
    with pytest.raises(ValidationError) as refused:
        raw_from_proto(request)
    assert refused.value.field == "chat.tools[0].parameters_json"


@pytest.mark.parametrize("kwargs_json", ["{oops", "[1]", '"x"'])
def test_template_kwargs_that_are_not_a_json_object_name_the_field(kwargs_json):
    request = generation_pb2.GenerateRequest(chat=generation_pb2.Chat(
        messages=[generation_pb2.ChatMessage(role="user", content="x")], chat_template_kwargs_json=kwargs_json))
    with pytest.raises(ValidationError) as refused:
        raw_from_proto(request)
    assert refused.value.field == "chat.chat_template_kwargs_json"
