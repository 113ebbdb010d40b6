"""Structured-output request fields: OpenAI / vLLM bodies, gRPC codec, the shared limits (no xgrammar)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, chat_to_raw, completion_to_raw
from gateway.validation import ValidationError
from stepahead import codec, limits
from stepahead.plan import SamplingParams, StructuredKind, StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def completion(**fields) -> StructuredOutput | None:
    return completion_to_raw(CompletionRequest.model_validate({"prompt": "x", **fields}), 0).sampling.structured


@pytest.mark.parametrize("fields, want", [
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "object"}'}},
     StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "object"}')),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutput(StructuredKind.REGEX, "a+")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput(StructuredKind.CHOICE, choices=("x", "y"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(StructuredKind.JSON_OBJECT)),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(StructuredKind.JSON_OBJECT)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
     StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])
def test_http_fields_map_to_one_constraint(fields, want):
    assert completion(**fields) == want
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})
    assert chat_to_raw(chat, 0).sampling.structured == want


@pytest.mark.parametrize("fields, field", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema"),
])
def test_ambiguous_or_incomplete_http_constraints_are_refused(fields, field):
    with pytest.raises(ValidationError) as exc:
        completion(**fields)
    assert exc.value.field == field


@pytest.mark.parametrize("structured", [
    StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    StructuredOutput(StructuredKind.JSON_OBJECT),
    StructuredOutput(StructuredKind.REGEX, "[0-9]+"),
    StructuredOutput(StructuredKind.CHOICE, choices=("a", "b c")),
    StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "x"'),
])
def test_codec_round_trip(structured):
    p = SamplingParams(max_tokens=7, structured=structured)
    assert codec.sampling_from_proto(codec.sampling_to_proto(p), 1) == p


def test_codec_without_a_constraint_or_with_json_object_false():
    from stepahead.v1 import common_pb2

    assert codec.sampling_from_proto(codec.sampling_to_proto(SamplingParams()), 16).structured is None
    msg = common_pb2.SamplingParams(structured_outputs=common_pb2.StructuredOutputs(json_object=False))
    assert codec.sampling_from_proto(msg, 16).structured is None


def check(structured: StructuredOutput, **sampling):
    return limits.check_sampling(SamplingParams(structured=structured, **sampling), 100)


@pytest.mark.parametrize("structured, sampling, field, words", [
    (StructuredOutput(StructuredKind.JSON_SCHEMA, "{"), {}, "structured_outputs.json", "not valid JSON"),
    (StructuredOutput(StructuredKind.JSON_SCHEMA, "[1]"), {}, "structured_outputs.json", "JSON object"),
    (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": 5}'), {}, "structured_outputs.json", "JSON schema"),
    (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"a":' * 100 + "1" + "}" * 100), {}, "structured_outputs.json",
     "deeper"),
    (StructuredOutput(StructuredKind.JSON_SCHEMA, '"' + "x" * 70000 + '"'), {}, "structured_outputs.json", "bytes"),
    (StructuredOutput(StructuredKind.REGEX, "(a"), {}, "structured_outputs.regex", "regular expression"),
    (StructuredOutput(StructuredKind.REGEX, ""), {}, "structured_outputs.regex", "empty"),
    (StructuredOutput(StructuredKind.CHOICE), {}, "structured_outputs.choice", "alternatives"),
    (StructuredOutput(StructuredKind.CHOICE, choices=("",)), {}, "structured_outputs.choice", "characters"),
    (StructuredOutput(StructuredKind.CHOICE, choices=tuple("x" * i for i in range(1, 300))), {},
     "structured_outputs.choice", "alternatives"),
    (StructuredOutput(StructuredKind.GRAMMAR, "  "), {}, "structured_outputs.grammar", "empty"),
    (StructuredOutput(StructuredKind.JSON_OBJECT, "x"), {}, "structured_outputs.json_object", "no text"),
    (StructuredOutput(StructuredKind.REGEX, "a"), {"ignore_eos": True}, "sampling.ignore_eos", "EOS"),
    (StructuredOutput(StructuredKind.REGEX, "a"), {"min_tokens": 1}, "sampling.min_tokens", "structured"),
])
def test_limits_refuse_bad_constraints_naming_the_field(structured, sampling, field, words):
    with pytest.raises(limits.LimitError) as exc:
        check(structured, **sampling)
    assert exc.value.field == field and words in exc.value.reason


def test_limits_accept_good_constraints_unchanged():
    for s in (StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)), StructuredOutput(StructuredKind.REGEX, "a|b"),
              StructuredOutput(StructuredKind.CHOICE, choices=("a",)), StructuredOutput(StructuredKind.JSON_OBJECT)):
        assert check(s).structured == s


def test_gateway_and_scheduler_never_import_xgrammar():
    code = ("import sys, gateway.server, gateway.http_server, scheduler_service.server, stepahead.limits; "
            "assert 'xgrammar' not in sys.modules and 'torch' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
