"""Logprobs in the gateway: aligned with the text a choice actually returns (pure domain code).

The scheduler sends one `Logprobs` per committed token and the prompt logprobs by position.
Here each token gets its text piece (the incremental detokenizer fed one token at a time, so
the pieces concatenate to the output text exactly; a token ending inside a UTF-8 character
has an empty piece and the next one carries the character) and its offset in the choice's
text. An entry goes out once the text it starts in went out, so text held back by a
possible stop string holds its tokens' logprobs back too; when a stop string ends the
choice, the tokens that start after the returned text are dropped with it. Prompt logprobs
are kept by position (a request resubmitted after a scheduler failure may send some again)
and go out, once, when every prompt position has one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from stepahead.logprobs import Logprobs


class TopLogprob(NamedTuple):
    """One of a position's likely tokens."""

    token_id: int
    text: str  # the token decoded alone
    logprob: float
    token_bytes: bytes  # the bytes it stands for (`GatewayTokenizer.token_bytes`)


@dataclass(frozen=True)
class TokenLogprob:
    """One returned position: its token, text piece, offset in the choice's text and top-k."""

    token_id: int
    token: str  # its piece of the text ("" for a token that ends inside a UTF-8 character)
    token_bytes: bytes  # the bytes the token stands for, whole or part of a character
    logprob: float | None  # None: the first prompt token (nothing before it)
    top: tuple[TopLogprob, ...]  # most likely first
    offset: int


class TokenText:
    """Token id -> its text alone (for top-k entries) and its bytes, cached per request."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def raw(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._tokenizer.token_bytes(token_id)
        return raw

    def entry(self, lp: Logprobs | None, token_id: int, piece: str, offset: int) -> TokenLogprob:
        if lp is None:
            return TokenLogprob(token_id, piece, self.raw(token_id), None, (), offset)
        top = tuple(TopLogprob(t, self(t), v, self.raw(t)) for t, v in lp.top)
        return TokenLogprob(token_id, piece, self.raw(token_id), lp.logprob, top, offset)


class OutputLogprobs:
    """One choice's output logprobs, released in step with its returned text."""

    def __init__(self, token_text: TokenText) -> None:
        self._text = token_text
        self._pending: deque[TokenLogprob] = deque()
        self._cursor = 0  # offset of the next token's piece in the choice's text (before stop cuts)
        self._emitted = 0  # characters of text returned so far

    def add(self, token_ids: Sequence[int], pieces: Sequence[str], logprobs: Sequence[Logprobs]) -> None:
        if len(logprobs) != len(token_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        for t, piece, lp in zip(token_ids, pieces, logprobs):
            self._pending.append(self._text.entry(lp, t, piece, self._cursor))
            self._cursor += len(piece)

    def release(self, text: str, finished: bool, cut_by_stop_string: bool) -> tuple[TokenLogprob, ...]:
        """After `text` went out: the entries that now belong to returned text."""
        self._emitted += len(text)
        out = []
        while self._pending and (self._pending[0].offset < self._emitted or (finished and not cut_by_stop_string)):
            out.append(self._pending.popleft())
        if finished:
            self._pending.clear()
        return tuple(out)


class PromptLogprobsCollector:
    """One choice's prompt logprobs, by position; complete once positions 1..P-1 arrived."""

    def __init__(self, prompt_ids: Sequence[int], token_text: TokenText, decode_pieces: Callable[[list[int]], list[str]]
                 ) -> None:
        self._prompt = list(prompt_ids)
        self._text = token_text
        self._decode_pieces = decode_pieces
        self._by_position: dict[int, Logprobs] = {}
        self._sent = False

    @property
    def complete(self) -> bool:
        return len(self._by_position) >= len(self._prompt) - 1

    def add(self, start: int, entries: Sequence[Logprobs]) -> None:
        for i, lp in enumerate(entries):
            pos = start + i
            if not 1 <= pos < len(self._prompt) or lp.token_id != self._prompt[pos]:
                raise ValueError(f"prompt logprobs for position {pos} do not match the prompt")
            self._by_position.setdefault(pos, lp)

    def take(self) -> tuple[TokenLogprob, ...] | None:
        """Every prompt position's entry (the first with logprob None), once, when complete."""
        if self._sent or not self.complete:
            return None
        self._sent = True
        out, offset = [], 0
        for pos, (t, piece) in enumerate(zip(self._prompt, self._decode_pieces(self._prompt))):
            out.append(self._text.entry(self._by_position.get(pos), t, piece, offset))
            offset += len(piece)
        return tuple(out)
