"""Stop-string matcher against a whole-text oracle, with arbitrary delta splits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401


def oracle(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan the full text position by position: the first stop string to complete wins,
    the longest if several complete at once. Returns (final text, matched stop)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]  # may contain empty deltas


ALPHABET = "ab\u00e9\U0001f600"  # small alphabet: matches and near-misses are frequent
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4)


def run_stream(deltas: list[str], stops: list[str], include: bool) -> tuple[StopStringMatcher, list[str]]:
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    out: list[str] = []
    received = ""
    for delta in deltas:
        received += delta
        out.append(matcher.feed(delta))
        emitted = "".join(out)
        # Never sent anything a continuation could take back: whatever completes a stop
        # string next (any stop, entered at any point), the sent text stays a prefix.
        for stop in stops:
            for k in range(len(stop)):
                final, _ = oracle(received + stop[k:], stops, include)
                assert final.startswith(emitted), (received, stop[k:], emitted)
        if matcher.stopped:
            break
    if not matcher.stopped:
        out.append(matcher.finish())
    return matcher, out


@given(text=st.text(ALPHABET, max_size=30), stops=stop_lists, cuts=st.lists(st.integers(0, 30)), include=st.booleans())
def test_matches_whole_text_oracle(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    matcher, out = run_stream(split(text, cuts), stops, include)
    expected_text, expected_stop = oracle(text, stops, include)
    assert "".join(out) == matcher.text == expected_text
    assert matcher.matched_stop == expected_stop
    assert matcher.stopped == (expected_stop is not None)


@given(text=st.text(ALPHABET, max_size=30), stops=stop_lists, cuts=st.lists(st.integers(0, 30)))
def test_result_does_not_depend_on_the_split(text: str, stops: list[str], cuts: list[int]) -> None:
    whole, _ = run_stream([text], stops, include=False)
    pieces, _ = run_stream(split(text, cuts), stops, include=False)
    one_char, _ = run_stream(list(text), stops, include=False)
    assert whole.text == pieces.text == one_char.text
    assert whole.matched_stop == pieces.matched_stop == one_char.matched_stop


def test_stop_spanning_deltas_is_held_back_then_cut() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("Hello S") == "Hello "
    assert matcher.feed("T") == ""
    assert matcher.feed("OP and more") == ""
    assert matcher.stopped and matcher.matched_stop == "STOP"
    assert matcher.text == "Hello "


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("ART") == "START"
    assert matcher.feed("S") == ""
    assert matcher.finish() == "S"
    assert not matcher.stopped and matcher.text == "a STARTS"


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["</s>", "\n\n"], include_stop_str_in_output=True)
    assert matcher.feed("x</") == "x"
    assert matcher.feed("s>y") == "</s>"
    assert matcher.text == "x</s>" and matcher.matched_stop == "</s>"


@pytest.mark.parametrize(
    ("stops", "deltas", "text", "matched"),
    [
        (["abcd", "bc"], ["xab", "cd"], "xa", "bc"),  # "bc" completes before "abcd" does
        (["bc", "abc"], ["xa", "bc"], "x", "abc"),  # both complete at once: the longer wins
        (["aa"], ["a", "a", "a"], "", "aa"),  # self-overlapping stop
        (["aab"], ["a", "a", "a", "b"], "a", "aab"),  # hold the longest possible start
        (["b", "ab"], ["", "a", "", "b"], "", "ab"),  # empty deltas change nothing
    ],
)
def test_overlapping_stops(stops: list[str], deltas: list[str], text: str, matched: str) -> None:
    matcher, out = run_stream(deltas, stops, include=False)
    assert matcher.text == "".join(out) == text
    assert matcher.matched_stop == matched


def test_no_stops_passes_everything_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == "abc"
    assert matcher.feed("") == ""
    assert matcher.finish() == ""
    assert matcher.text == "abc" and not matcher.stopped


def test_with_detokenizer_token_by_token(tiny_tokenizer) -> None:
    text = "print('日本')\n### END ###\nnever shown"
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tiny_tokenizer)
    matcher = StopStringMatcher(["### END", "日本語"])
    sent = []
    for token_id in ids:
        sent.append(matcher.feed(detok.append([token_id])))
        if matcher.stopped:
            break
    assert "".join(sent) == matcher.text == "print('日本')\n"
    assert matcher.matched_stop == "### END"


def test_bad_input_raises() -> None:
    with pytest.raises(TypeError, match="sequence of strings, not the string"):
        StopStringMatcher("STOP")
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError, match="must be strings"):
        StopStringMatcher([3])
    matcher = StopStringMatcher(["x"])
    with pytest.raises(TypeError, match="must be a string"):
        matcher.feed(b"bytes")
    matcher.feed("axb")
    with pytest.raises(RuntimeError, match="after the text was stopped"):
        matcher.feed("more")
    matcher.finish()
    with pytest.raises(RuntimeError, match="finish called twice"):
        matcher.finish()
