"""Each tool-call parser on hand-written outputs in its format's documented syntax: the
non-streaming result, the same result streamed whatever the text's split into pieces (every
single cut, and random cuts), and malformed output coming back as plain content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tool_parsers import PARSERS, CallStream, ToolCallParser

H, L, M, P = ToolCallParser.HERMES, ToolCallParser.LLAMA3_JSON, ToolCallParser.MISTRAL, ToolCallParser.PYTHONIC
WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
NESTED = ("book", {"when": {"day": "mon", "slots": [1, 2]}, "note": "a } and a \" inside"})
EMPTY = ("now", {})

# (parser, text, expected content, expected calls as (name, arguments object))
CASES = [
    (H, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [WEATHER]),
    (H, 'Let me look.\n<tool_call>\n' + json.dumps({"name": NESTED[0], "arguments": NESTED[1]}) + '\n</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>', "Let me look.", [NESTED, EMPTY]),
    (H, "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    (L, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
    (L, '<|python_tag|>' + json.dumps({"name": NESTED[0], "parameters": NESTED[1]}) + '; {"name": "now", "parameters": {}}',
     "", [NESTED, EMPTY]),
    (L, "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    (M, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "", [WEATHER]),
    (M, 'Sure. [TOOL_CALLS][' + json.dumps({"name": NESTED[0], "arguments": NESTED[1]}) + ', {"name": "now", "arguments": {}}]',
     "Sure.", [NESTED, EMPTY]),
    (M, "Plain [TOOL answer.", "Plain [TOOL answer.", []),
    (P, '[get_weather(city="Paris", unit="celsius")]', "", [WEATHER]),
    (P, "[book(when={'day': 'mon', 'slots': [1, 2]}, note='a } and a \" inside'), now()]", "", [NESTED, EMPTY]),
    (P, "Paris is in France.", "Paris is in France.", []),
]

MALFORMED = [
    (H, 'Before <tool_call>{"name": "f", "arguments": {"x": 1}</tool_call> after'),  # unbalanced
    (H, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (H, '<tool_call>not json at all</tool_call>'),
    (H, '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>'),  # arguments not an object
    (L, '{"name": "f", "parameters": {"x": 1}'),
    (L, '{"name": "f", "parameters": {}} and then prose'),
    (M, '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}'),
    (M, '[TOOL_CALLS] {"name": "f"}'),
    (P, '[f(1, 2)]'),  # positional arguments
    (P, '[f(x=open("/etc/passwd"))]'),  # not a literal
    (P, '[f(x=1'),
]


def streamed(kind: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """What a client streaming `pieces` receives: content, calls (arguments joined), ids."""
    stream, content, calls, ids = CallStream(), "", [], []
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        delta, deltas = stream.update(PARSERS[kind](text, i == len(pieces) - 1))
        content += delta
        for d in deltas:
            if d.index == len(calls):
                assert d.name is not None and d.id is not None
                calls.append([d.name, ""])
                ids.append(d.id)
            else:
                assert d.name is None and d.id is None
            calls[d.index][1] += d.arguments
    return content, [(name, json.loads(args)) for name, args in calls], ids


@pytest.mark.parametrize("kind, text, content, calls", CASES)
def test_whole_output(kind, text, content, calls):
    parsed = PARSERS[kind](text, True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


@pytest.mark.parametrize("kind, text, content, calls", CASES)
def test_every_single_cut_and_character_by_character(kind, text, content, calls):
    for cut in range(1, len(text)):
        assert streamed(kind, [text[:cut], text[cut:]])[:2] == (content, calls), cut
    got_content, got_calls, ids = streamed(kind, list(text))
    assert (got_content, got_calls) == (content, calls)
    assert len(set(ids)) == len(ids)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 400), max_size=12))
def test_random_splits(case, cuts):
    kind, text, content, calls = case
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] or [text]
    assert streamed(kind, pieces)[:2] == (content, calls)


@pytest.mark.parametrize("kind, text", MALFORMED)
def test_malformed_output_is_plain_content(kind, text):
    parsed = PARSERS[kind](text, True)
    assert parsed.calls == () and parsed.content == text
