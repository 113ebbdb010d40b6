"""Chat with tools in the gateway, without daemons: a tool exchange in the history renders
exactly as transformers' `apply_chat_template(tools=...)` does; the chat format splits
scripted model outputs into reasoning, content and tool calls, streamed (OpenAI's deltas)
or whole; the reasoning parsers on scripted outputs."""

from __future__ import annotations

import json
import shutil

import pytest

from gateway.chat_output import ChatParsing
from gateway.generation import ChoiceOutput
from gateway.openai_format import ChatFormat
from gateway.openai_protocol import ChatCompletionRequest, chat_parsing, chat_to_raw, message_dict, tool_dicts
from gateway.output import FinishReason, Output
from gateway.reasoning_parsers import ReasoningParser, split
from gateway.tokenizer import GatewayTokenizer
from gateway.tool_parsers import ToolCallParser
from tests.fixtures_models import tiny_model_dir  # noqa: F401

# A Hermes-style template (the shape Qwen2.5's has): tools in the system turn, calls as
# <tool_call> JSON in the assistant's turn, results as <tool_response> in a user turn.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ARGS = '{"city": "Paris"}'
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def tools_model_dir(tiny_model_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("tools-template")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return out


def test_a_tool_exchange_renders_as_transformers_renders_it(tools_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tools_model_dir)
    # transformers' documented form: the call's arguments as an object
    hf_messages = json.loads(json.dumps(HISTORY))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = json.loads(ARGS)
    hf_messages[1]["content"] = ""
    want = hf.apply_chat_template(hf_messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "<tool_call>" in want and "get_weather" in want and "<tool_response>" in want  # the template used them

    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    raw = chat_to_raw(body, 0)
    ours = GatewayTokenizer(tools_model_dir)
    got = ours.apply_chat_template([dict(m) for m in raw.chat_messages], add_generation_prompt=True,
                                   tools=[dict(t) for t in raw.chat_tools])
    assert got == want
    assert ours.encode(got, add_special_tokens=False) == hf.apply_chat_template(
        hf_messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [message_dict(m, i) for i, m in enumerate(body.messages)] == list(raw.chat_messages)
    assert tool_dicts(body.tools) == [WEATHER]


def outputs(pieces: list[str]) -> list[ChoiceOutput]:
    """A choice's upstream outputs carrying `pieces`, the last one finishing (stop)."""
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(ChoiceOutput(0, Output(piece, (i,), FinishReason.STOP if last else None, "",  i + 1), 3, 0))
    return out


def run(parsing: ChatParsing, text: str, cuts: list[int]) -> tuple[dict, dict]:
    """(the whole response's message and finish reason, what the stream's deltas add up to)."""
    points = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    whole = ChatFormat("id", "m", 1, parsing=parsing)
    for choice in outputs(pieces):
        whole.accumulate(choice)
    body = whole.full()["choices"][0]
    streamed = ChatFormat("id", "m", 1, parsing=parsing)
    got = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for choice in outputs(pieces):
        for chunk in streamed.chunk(choice):
            entry = chunk["choices"][0]
            delta, finish = entry["delta"], entry["finish_reason"] or finish
            got["content"] += delta.get("content") or ""
            got["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls", ()):
                slot = got["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                if "id" in call:
                    assert slot["name"] is None and call["type"] == "function"
                    slot["name"] = call["function"]["name"]
                slot["arguments"] += call["function"]["arguments"]
    got["finish_reason"] = finish
    return body, got


HERMES_OUT = 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_OUT = "<think>\nThe user wants weather.\n</think>\n\n" + HERMES_OUT


@pytest.mark.parametrize("parsing, text, message", [
    (ChatParsing(tool_parser=ToolCallParser.HERMES), HERMES_OUT,
     {"content": "I will check.", "calls": [("get_weather", ARGS)], "reasoning": None}),
    (ChatParsing(ReasoningParser.QWEN3, ToolCallParser.HERMES), THINK_OUT,
     {"content": "I will check.", "calls": [("get_weather", ARGS)], "reasoning": "\nThe user wants weather.\n"}),
    (ChatParsing(ReasoningParser.DEEPSEEK_R1), "Two plus two.</think>It is 4.",
     {"content": "It is 4.", "calls": [], "reasoning": "Two plus two."}),
    (ChatParsing(tool_parser=ToolCallParser.HERMES), '<tool_call>{"name": broken</tool_call>',
     {"content": '<tool_call>{"name": broken</tool_call>', "calls": [], "reasoning": None}),
])
def test_scripted_outputs_split_the_same_streamed_or_whole(parsing, text, message):
    for cuts in ([], [len(text) // 3, len(text) // 2], list(range(1, len(text)))):
        body, got = run(parsing, text, cuts)
        m = body["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ())]
        assert (m["content"] or "", calls, m.get("reasoning_content")) == \
            (message["content"], message["calls"], message["reasoning"])
        assert body["finish_reason"] == ("tool_calls" if calls else "stop") == got["finish_reason"]
        assert got["content"] == message["content"]
        assert got["reasoning_content"] == (message["reasoning"] or "")
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == calls
        if calls:
            assert m["content"] is None or m["content"] == message["content"]
            assert all(c["id"].startswith("call_") for c in m["tool_calls"])


@pytest.mark.parametrize("kind, text, want", [
    (ReasoningParser.DEEPSEEK_R1, "Let me think.\n</think>\n\nParis.", ("Let me think.\n", "Paris.")),
    (ReasoningParser.DEEPSEEK_R1, "<think>still thinking", ("still thinking", "")),  # cut by max_tokens
    (ReasoningParser.QWEN3, "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "Paris.")),
    (ReasoningParser.QWEN3, "Paris.", ("", "Paris.")),  # thinking off: no block
    (ReasoningParser.QWEN3, "a </think> b", ("", "a </think> b")),
])
def test_reasoning_split_on_scripted_outputs(kind, text, want):
    assert split(kind, text, True)[:2] == want
    for cut in range(len(text)):
        early = split(kind, text[:cut], False)
        assert want[0].startswith(early.reasoning) and want[1].startswith(early.content), cut


def test_auto_needs_a_parser_and_required_becomes_a_schema():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                                 "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(chat_to_raw(body, 0).sampling.structured.spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert chat_parsing(body, None, None).forced is not None
    auto = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]})
    assert chat_parsing(auto, ToolCallParser.PYTHONIC, None).tool_parser is ToolCallParser.PYTHONIC
    assert chat_to_raw(auto, 0).sampling.structured is None
