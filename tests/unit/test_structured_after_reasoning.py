"""With a reasoning parser, a chat request's structured output or enforced tool call is the
answer's: the gateway gates it on `</think>` (`StructuredOutput.start_after`), unless the
prompt already closed the block; the gate survives the wire to the scheduler."""

from __future__ import annotations

import pytest

from gateway.generation import Frontend
from gateway.metrics import GatewayMetrics
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, chat_to_raw, completion_to_raw
from gateway.reasoning_parsers import CLOSE, ReasoningParser
from stepahead import codec
from stepahead.v1 import scheduler_pb2
from tests.unit.test_gateway_frontend import CharTokenizer, FakeLink

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class TemplateTokenizer(CharTokenizer):
    """Renders a conversation as its contents, then `suffix` (what the template's generation
    prompt would end with)."""

    chat_template = "set"

    def __init__(self, suffix: str = "") -> None:
        self.suffix = suffix

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools, continue_final_message):
        return "".join(m["content"] for m in messages) + self.suffix


def frontend(tokenizer, parser: ReasoningParser | None = ReasoningParser.DEEPSEEK_R1) -> tuple[Frontend, FakeLink]:
    link = FakeLink()
    hello = scheduler_pb2.WorkerHello(model_name="m", max_model_len=256, vocab_size=100)
    return Frontend(tokenizer, codec.worker_info_from_proto(hello), link, 1 << 20, GatewayMetrics(),
                    reasoning_parser=parser), link


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=8, **kw)


NAMED = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
SCHEMA = dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})


@pytest.mark.parametrize("fields", [NAMED, dict(tools=[WEATHER], tool_choice="required"), SCHEMA],
                         ids=["named", "required", "response_format"])
def test_a_constraint_starts_after_the_reasoning_and_travels_upstream(fields):
    tokenizer = TemplateTokenizer("<think>\n")  # DeepSeek-R1's template opens the block
    front, link = frontend(tokenizer)
    valid = front.validate(chat_to_raw(chat(**fields), 10))
    close = tuple(tokenizer.encode(CLOSE, add_special_tokens=False))
    assert valid.sampling.structured.start_after == close
    front.start(valid, "r", lambda _: None, "http")
    sent = codec.sampling_from_proto(link.submitted[0].sampling, default_max_tokens=1)
    assert sent.structured == valid.sampling.structured  # the scheduler and the worker see the gate


def test_no_gate_without_a_parser_for_completions_or_when_the_prompt_closed_the_block():
    plain, _ = frontend(TemplateTokenizer("<think>\n"), parser=None)
    assert plain.validate(chat_to_raw(chat(**NAMED), 10)).sampling.structured.start_after == ()
    front, _ = frontend(TemplateTokenizer("<think>\n\n</think>\n\n"))  # Qwen3, enable_thinking false
    assert front.validate(chat_to_raw(chat(**NAMED), 10)).sampling.structured.start_after == ()
    front, _ = frontend(TemplateTokenizer())
    completion = CompletionRequest(prompt="hi", structured_outputs={"json_object": True})
    assert front.validate(completion_to_raw(completion, 10)).sampling.structured.start_after == ()
