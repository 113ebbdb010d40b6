"""`/v1/responses` with the official `openai` client's `responses.create`, unchanged: text
in and out (equal to the chat completion of the same conversation, greedy), streamed events,
an enforced function call and a function result in the input; stored state refused."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.test_openai_tools import SCHEMAS, WEATHER

FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_text_round_trip_equals_the_chat_completion(openai_client):
    out = openai_client.responses.create(model="tiny", input="hi", max_output_tokens=12, temperature=0,
                                         instructions="Be brief.", store=False)
    chat = openai_client.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_streamed_events_add_up_to_the_response(openai_client):
    kwargs = dict(model="tiny", input=[{"role": "user", "content": "hi"}], max_output_tokens=12, temperature=0,
                  store=False)
    whole = openai_client.responses.create(**kwargs)
    events = list(openai_client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_an_enforced_function_call_and_its_result(openai_client, stream):
    kwargs = dict(model="tiny", input="weather?", max_output_tokens=80, temperature=1.0, store=False, extra_body={"seed": 4},
                  tools=[FLAT_WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        events = list(openai_client.responses.create(stream=True, **kwargs))
        out = events[-1].response
        pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    else:
        out = openai_client.responses.create(**kwargs)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    if stream:
        assert pieces == calls[0].arguments
    follow = openai_client.responses.create(
        model="tiny", max_output_tokens=4, temperature=0, store=False, tools=[FLAT_WEATHER], tool_choice="none",
        input=[{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}])
    assert follow.status in ("completed", "incomplete")


def test_stored_state_is_refused_naming_the_field(openai_client):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.responses.create(model="tiny", input="hi", previous_response_id="resp_x")
    assert refused.value.body["param"] == "previous_response_id"
