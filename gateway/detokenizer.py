"""Incremental detokenization: output token ids in, streamable text deltas out.

Pure Python (no torch, no grpc). Works with a `tokenizers.Tokenizer` or a transformers
tokenizer: anything with `decode(ids, skip_special_tokens=...)`.

Contract: the concatenation of every delta returned by `append` plus the one returned by
`finish` equals `tokenizer.decode(output_ids, skip_special_tokens=...)` exactly, and no
delta is ever taken back. Text whose decoding ends in U+FFFD (an incomplete multi-byte
UTF-8 sequence, e.g. a byte-level token holding the first byte of an emoji) is held back
until a later token completes it, or until `finish` flushes it.

Cost per token is O(window), not O(output): like vLLM's incremental detokenizer, only the
ids from `prefix_offset` on are decoded — the tokens of the last emitted delta (context, so
that decoders which strip or merge at the start of a sequence behave as in a full decode)
plus the tokens not yet emitted.

Why not `tokenizers.decoders.DecodeStream` (tokenizers 0.23): it does not give the same
text. An output ending in an incomplete UTF-8 sequence decodes to U+FFFD with `decode`,
but DecodeStream holds those bytes back forever (it has no flush); on the `tiny`
tokenizer, 18 of 600 random id sequences differ (`docs/http-api.md`'s contract: the
deltas concatenate to `decode(output_ids)`).

The text is the decoding of the *output* ids alone, exactly as `decode(output_ids)` gives
it; the prompt is deliberately not used as context, since a prompt that ends in the middle
of a character (or a Metaspace decoder's leading space) would otherwise change the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def vocab_size_of(tokenizer) -> int:
    """Number of ids `tokenizer` can decode (added tokens included)."""
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    return len(tokenizer)  # transformers tokenizers


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas; one instance per request."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._vocab_size = vocab_size_of(tokenizer)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (context for the next delta)
        self._read_offset = 0  # ids before this index have been emitted as text
        self._finished = False
        self._num_decoded_ids = 0  # ids passed to `decode` so far (cost accounting)

    @property
    def output_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    @property
    def num_decoded_ids(self) -> int:
        """Total ids decoded so far: stays proportional to the output length."""
        return self._num_decoded_ids

    def append(self, token_ids: Iterable[int]) -> str:
        """Add output ids; return the new text that is now certain (may be empty)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.append called after finish()")
        self._ids.extend(self._validated(token_ids))
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or an incomplete character at the end: wait
        return self._emit(prefix_text, full_text)

    def finish(self) -> str:
        """Flush whatever is held back (an incomplete tail decodes to U+FFFD, as in `decode`)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.finish called twice")
        self._finished = True
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text):
            return ""
        return self._emit(prefix_text, full_text)

    def _emit(self, prefix_text: str, full_text: str) -> str:
        # The window's context part decodes the same alone as at the window's start.
        assert full_text.startswith(prefix_text), (prefix_text, full_text)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        """(decoded context ids, decoded context + pending ids) for the current window."""
        window = self._ids[self._prefix_offset :]
        context = window[: self._read_offset - self._prefix_offset]
        return self._decode(context), self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self._num_decoded_ids += len(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _validated(self, token_ids: Iterable[int]) -> list[int]:
        ids = list(token_ids)
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise TypeError(f"token ids must be ints, got {token_id!r}")
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})")
        return ids
