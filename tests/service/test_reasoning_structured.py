"""An enforced tool call with `--reasoning-parser` (issue 32): the reasoning is free, the call
after `</think>` is enforced and validates, and `max_tokens` counts both; over HTTP with the
official `openai` client against real daemons on the random-weight `tiny` model, and over gRPC
(`reasoning`, `content`, complete `tool_calls` on the final message).

The tiny model writes noise: a logit bias on the tokens of `</think>` makes it close its
reasoning block within a few hundred tokens in some of the seeded choices. Before the gate
(`StructuredOutput.start_after`), the schema applied from the first token, so the block
never closed and the call was lost in `reasoning_content`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from stepahead.v1 import common_pb2, generation_pb2
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.service.openai_helpers import openai_client_of, served as serve_checked
from tests.service.test_openai_tools import SCHEMAS, TIME, WEATHER

ASK = [{"role": "user", "content": "Think first, then call get_weather."}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served(tiny_model_dir):  # noqa: F811
    with serve_checked(tiny_model_dir, "--reasoning-parser", "deepseek_r1") as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with openai_client_of(served) as c:
        yield c


def close_bias(tokenizer) -> dict[str, float]:
    return {str(t): 8.0 for t in tokenizer.encode("</think>", add_special_tokens=False)}


def test_the_call_after_free_reasoning_validates(client, tiny_tokenizer):  # noqa: F811
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=400, temperature=1.0, seed=11, n=8,
                                         tools=[WEATHER, TIME], tool_choice=NAMED,
                                         logit_bias=close_bias(tiny_tokenizer))
    called = [c for c in out.choices if c.finish_reason == "tool_calls"]
    assert called, [(c.finish_reason, c.message.reasoning_content[-40:]) for c in out.choices]
    for choice in called:
        assert choice.message.reasoning_content  # free text, whatever the schema
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    for choice in out.choices:
        assert choice.finish_reason in ("tool_calls", "length")  # never an answer that broke the schema


def test_max_tokens_counts_the_reasoning(client):
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=1.0, seed=3,
                                         tools=[WEATHER], tool_choice="required")
    (choice,) = out.choices
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12
    assert choice.message.reasoning_content and not choice.message.tool_calls


def test_grpc_splits_reasoning_and_calls_out_of_its_text(served, tiny_tokenizer):  # noqa: F811
    """Over gRPC the same request's choices carry `reasoning`, `content` and complete
    `tool_calls` that add up to the raw `text` they streamed: the reasoning is what precedes
    `</think>`, the call's arguments what follows it (sampled output depends on the batch, so
    the oracle is each choice's own text, not an HTTP run)."""
    bias = close_bias(tiny_tokenizer)
    request = generation_pb2.GenerateRequest(
        n=8, chat=generation_pb2.Chat(
            messages=[generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in ASK],
            tools=[generation_pb2.Tool(name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"]))
                   for t in (WEATHER, TIME)],
            tool_choice=generation_pb2.ToolChoice(function="get_weather")),
        sampling=common_pb2.SamplingParams(max_tokens=400, temperature=1.0, seed=11,
                                           logit_bias={int(t): b for t, b in bias.items()}))
    got = {i: {"text": "", "reasoning": "", "content": "", "calls": None, "finish": None} for i in range(8)}
    for reply in served.gateway.Generate(request, timeout=300):
        g = got[reply.index]
        assert g["finish"] is None  # nothing after a choice's final message
        g["text"] += reply.text
        g["reasoning"] += reply.reasoning
        g["content"] += reply.content
        if reply.finish_reason:
            g["finish"], g["calls"] = reply.finish_reason, [(c.name, c.arguments) for c in reply.tool_calls]
    called = [g for g in got.values() if g["finish"] == common_pb2.FINISH_REASON_TOOL_CALLS]
    assert called, [g["text"][-40:] for g in got.values()]
    for g in got.values():
        assert g["finish"] in (common_pb2.FINISH_REASON_TOOL_CALLS, common_pb2.FINISH_REASON_LENGTH)
    for g in called:
        before, sep, after = g["text"].partition("</think>")
        assert sep and g["reasoning"] == before.removeprefix("<think>").strip("\n")
        ((name, arguments),) = g["calls"]
        assert name == "get_weather" and after.strip() == arguments and g["content"] == ""
        jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
