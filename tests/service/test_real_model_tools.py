"""Tool calling on the built-in real model (`smollm2-135m`, whose template knows no tools)
with async scheduling (the default) and n-gram speculation on: a named function and
`required` return calls whose arguments parse and validate against the tools' schemas,
streamed or not, because the schema is enforced; and the hermes parser reads what it
writes in `auto` mode (content when it writes no call). The same over the public gRPC API:
the calls complete on the final message, equal to HTTP's; a tool history renders as
transformers does; malformed tools refused naming the proto field."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from stepahead.v1 import common_pb2, generation_pb2
from tests.fixtures_models import smollm2_model_dir  # noqa: F401
from tests.service.openai_helpers import openai_client_of, served as serve_checked
from tests.service.test_openai_tools import SCHEMAS, TIME, WEATHER, streamed_calls

NAME = "smollm2-135m"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
ASK = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]


@pytest.fixture(scope="module")
def served(smollm2_model_dir):  # noqa: F811
    with serve_checked(smollm2_model_dir, "--served-model-name", NAME, "--speculative-config", SPEC,
                       "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with openai_client_of(served) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_enforced_calls_validate(client, stream, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kwargs = dict(model=NAME, messages=ASK, max_tokens=96, temperature=0, tools=[WEATHER, TIME],
                  tool_choice=tool_choice)
    if stream:
        got, finish, _ = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        calls = [(c["name"], c["arguments"]) for c in got]
    else:
        out = client.chat.completions.create(**kwargs)
        finish = out.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    assert finish == "tool_calls" and calls
    for name, arguments in calls:
        assert name == "get_weather" or (choice == "required" and name in SCHEMAS)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_with_hermes_parses_or_gives_content(client):
    out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=48, temperature=0, tools=[WEATHER])
    message = out.choices[0].message
    if message.tool_calls:  # whatever it wrote parsed as a well-formed call
        assert out.choices[0].finish_reason == "tool_calls"
        json.loads(message.tool_calls[0].function.arguments)
    else:
        assert message.content
        assert out.choices[0].finish_reason in ("stop", "length")


def grpc_chat(messages: list[dict], tools: list[dict], max_tokens: int, **chat) -> generation_pb2.GenerateRequest:
    pb = [generation_pb2.ChatMessage(
        role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id", ""),
        tool_calls=[generation_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                    for c in m.get("tool_calls", ())]) for m in messages]
    tools_pb = [generation_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                                    parameters_json=json.dumps(t["function"]["parameters"])) for t in tools]
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=pb, tools=tools_pb, **chat),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))


@pytest.mark.parametrize("choice", ["named", "required"])
def test_enforced_calls_over_grpc_validate_and_equal_http(served, client, choice):
    """The calls arrive complete on the final message, validate against their schema, and are
    the calls the same greedy request gets over HTTP; what streamed in `text` is the output."""
    if choice == "named":
        grpc_choice = generation_pb2.ToolChoice(function="get_weather")
        http_choice = {"type": "function", "function": {"name": "get_weather"}}
    else:
        grpc_choice, http_choice = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_MODE_REQUIRED), "required"
    replies = list(served.gateway.Generate(grpc_chat(ASK, [WEATHER, TIME], 96, tool_choice=grpc_choice), timeout=300))
    final = replies[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS and final.tool_calls
    assert all(not r.tool_calls for r in replies[:-1])
    assert "".join(r.content for r in replies) == ""  # all of it was calls
    for call in final.tool_calls:
        assert call.id.startswith("call_")
        assert call.name == "get_weather" or (choice == "required" and call.name in SCHEMAS)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    text = "".join(r.text for r in replies)
    if choice == "named":
        assert text.strip() == final.tool_calls[0].arguments
    over_http = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=96, temperature=0,
                                               tools=[WEATHER, TIME], tool_choice=http_choice)
    assert [(c.function.name, c.function.arguments) for c in over_http.choices[0].message.tool_calls] == \
        [(c.name, c.arguments) for c in final.tool_calls]


def test_a_tool_history_over_grpc_renders_as_transformers(served, smollm2_model_dir):  # noqa: F811
    from transformers import AutoTokenizer

    args = '{"city": "Paris", "unit": "celsius"}'
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    hf_history = json.loads(json.dumps(history))
    hf_history[1]["tool_calls"][0]["function"]["arguments"] = json.loads(args)
    want = AutoTokenizer.from_pretrained(smollm2_model_dir).apply_chat_template(
        hf_history, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False)
    request = grpc_chat(history, [WEATHER], 4, tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_MODE_NONE))
    final = list(served.gateway.Generate(request, timeout=300))[-1]
    assert final.usage.prompt_tokens == len(want)
    assert not final.tool_calls and final.finish_reason != common_pb2.FINISH_REASON_TOOL_CALLS


@pytest.mark.parametrize("tool, field", [
    (generation_pb2.Tool(name="f", parameters_json="{oops"), "chat.tools[0].parameters_json"),
    (generation_pb2.Tool(name="bad name!"), "chat.tools[0].name"),
])
def test_bad_tools_over_grpc_are_refused_naming_the_field(served, tool, field):
    request = generation_pb2.GenerateRequest(chat=generation_pb2.Chat(
        messages=[generation_pb2.ChatMessage(role="user", content="hi")], tools=[tool],
        tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_MODE_REQUIRED)))
    with pytest.raises(grpc.RpcError) as refused:
        list(served.gateway.Generate(request, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field + ":"), refused.value.details()
