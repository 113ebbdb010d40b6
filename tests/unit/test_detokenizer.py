"""Incremental detokenizer against `tokenizer.decode` (the oracle) on the built-in tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401

MULTIBYTE_TEXTS = [
    "日本語のテキストと中文文本",
    "emoji 😀 family 👨‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "combining: e\u0301 a\u0308\u0323 Z\u0351\u0352\u0353 hangul \u1100\u1161\u11a8",
    "mixed ascii—dash “quotes” 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd end",
]


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Consecutive chunks of the given sizes (cycled); size 0 is an empty append."""
    out, i, k = [], 0, 0
    while i < len(ids):
        size = sizes[k % len(sizes)]
        k += 1
        out.append(ids[i : i + size])
        i += size
        if size == 0:  # after an empty append, make progress
            out.append(ids[i : i + 1])
            i += 1
    return out


def _stream(tokenizer, ids: list[int], sizes: list[int], skip_special_tokens: bool) -> list[str]:
    """Feed ids chunk by chunk; check the no-take-back property after every append."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas: list[str] = []
    seen: list[int] = []
    for chunk in _chunks(ids, sizes):
        seen.extend(chunk)
        deltas.append(detok.append(chunk))
        emitted = "".join(deltas)
        so_far = tokenizer.decode(seen, skip_special_tokens=skip_special_tokens)
        assert so_far.startswith(emitted), (emitted, so_far)
    deltas.append(detok.finish())
    assert detok.output_ids == tuple(ids)
    return deltas


@pytest.fixture(scope="module")
def byte_token_ids(tiny_tokenizer) -> list[int]:
    """Ids that carry single non-ASCII bytes: the pieces of multi-byte characters."""
    ids: set[int] = set()
    for text in MULTIBYTE_TEXTS:
        ids.update(tiny_tokenizer(text, add_special_tokens=False).input_ids)
    return sorted(ids)


@given(data=st.data())
def test_random_ids_match_decode(tiny_tokenizer, byte_token_ids, data) -> None:
    vocab = len(tiny_tokenizer)
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(byte_token_ids), st.integers(0, 4))
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=6), label="chunk sizes")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    deltas = _stream(tiny_tokenizer, ids, sizes, skip)
    assert "".join(deltas) == tiny_tokenizer.decode(ids, skip_special_tokens=skip)


@given(text=st.text().map(lambda t: t.replace(REPLACEMENT_CHAR, "?")), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_valid_text_never_streams_replacement_chars(tiny_tokenizer, text: str, sizes: list[int]) -> None:
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    deltas = _stream(tiny_tokenizer, ids, sizes, skip_special_tokens=False)  # text may spell "<|eos|>"
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_one_token_at_a_time(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text) / 2  # byte-level pieces: many tokens hold partial characters
    deltas = _stream(tiny_tokenizer, ids, [1], skip_special_tokens=True)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert deltas.count("") > 0  # some tokens had to be held back


def test_incomplete_tail_is_held_then_flushed(tiny_tokenizer) -> None:
    ids = tiny_tokenizer("ok 😀", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tiny_tokenizer)
    head = "".join(detok.append([i]) for i in ids[:-1])  # emoji's last byte missing
    assert head == "ok "
    flushed = detok.finish()
    assert head + flushed == tiny_tokenizer.decode(ids[:-1])
    assert flushed.endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tiny_tokenizer, skip: bool) -> None:
    tok = tiny_tokenizer
    body = tok("héllo", add_special_tokens=False).input_ids
    ids = [tok.bos_token_id, *body, tok.convert_tokens_to_ids("<|im_end|>"), *body, tok.eos_token_id]
    text = "".join(_stream(tok, ids, [1], skip_special_tokens=skip))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    expected = "héllohéllo" if skip else "<|bos|>héllo<|im_end|>héllo<|eos|>"
    assert text == expected


def test_only_special_tokens_when_skipped(tiny_tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=True)
    assert detok.append([tiny_tokenizer.eos_token_id, tiny_tokenizer.bos_token_id]) == ""
    assert detok.finish() == ""


def test_works_with_raw_tokenizers_library(tiny_model_dir) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "def f():\n    return '日本' + '😀'"
    ids = raw.encode(text, add_special_tokens=False).ids
    assert "".join(_stream(raw, ids, [1, 2], skip_special_tokens=True)) == text


def test_cost_per_token_is_bounded(tiny_tokenizer) -> None:
    import inspect

    import gateway.detokenizer as module

    source = inspect.getsource(module) + " 日本語のテキスト 😀" * 50
    ids = tiny_tokenizer(source, add_special_tokens=False).input_ids
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(tiny_tokenizer)
    text = "".join(detok.append([i]) for i in ids) + detok.finish()
    assert text == source
    # A whole-output decode per token would cost ~len(ids)**2 / 2 decoded ids.
    assert detok.num_decoded_ids < 12 * len(ids)


def test_metaspace_decoder_matches_decode() -> None:
    """A SentencePiece-style tokenizer (leading-space marker stripped at sequence start)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, hello there"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False))
    ids = tok.encode("hello the lazy fox jumps there").ids + [tok.token_to_id("</s>")]
    for sizes in ([1], [2, 1], [3]):
        for skip in (True, False):
            assert "".join(_stream(tok, ids, sizes, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_bad_input_raises(tiny_tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny_tokenizer)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.append([len(tiny_tokenizer)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.append([-1])
    with pytest.raises(TypeError, match="must be ints"):
        detok.append(["7"])
    detok.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        detok.append([5])
    with pytest.raises(RuntimeError, match="finish called twice"):
        detok.finish()
