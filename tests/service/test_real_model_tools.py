"""Tool calling on the built-in real model (`smollm2-135m`, whose template knows no tools)
with async scheduling (the default) and n-gram speculation on: a named function and
`required` return calls whose arguments parse and validate against the tools' schemas,
streamed or not, because the schema is enforced; and the hermes parser reads what it
writes in `auto` mode (content when it writes no call)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from testing.launcher import ServeProcess
from tests.fixtures_models import smollm2_model_dir  # noqa: F401
from tests.service.test_openai_tools import SCHEMAS, TIME, WEATHER, streamed_calls

NAME = "smollm2-135m"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
ASK = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]


@pytest.fixture(scope="module")
def client(smollm2_model_dir):  # noqa: F811
    with ServeProcess(smollm2_model_dir, "--served-model-name", NAME, "--speculative-config", SPEC,
                      "--tool-call-parser", "hermes", capture_stderr=True) as s:
        with openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            yield c
        problems = s.log_problems()
        assert not problems, problems


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
