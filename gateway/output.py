"""Per-request output processing in the gateway (pure domain code, no grpc).

Committed token ids in → text deltas out: incremental detokenization (never broken UTF-8,
deltas concatenate to `tokenizer.decode(output)`), then stop strings matched across token
boundaries. When a stop string matches, the request is finished here and the caller
aborts it upstream.

The token that stops a request upstream (EOS, or one of `stop_token_ids`: the scheduler's
FINISH_REASON_STOP) is returned among the token ids but, like a stop string, not in the text
unless `include_stop_str_in_output` (vLLM's rule; its id is the `stop_reason`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gateway.detokenizer import IncrementalDetokenizer
from gateway.logprob_output import OutputLogprobs, PromptLogprobsCollector, TokenLogprob, TokenText
from gateway.stop_strings import StopStringMatcher
from gateway.validation import ValidRequest
from stepahead.logprobs import Logprobs, PromptLogprobs
from stepahead.plan import FinishReason


class Output(NamedTuple):
    """What to send the client for one upstream event (a NamedTuple: immutable, and made once
    per streamed message, where a frozen dataclass's `__init__` costs several times more)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_reason: str = ""  # the stop string, or the stop token id, that ended the request
    num_output_tokens: int = 0  # tokens sent so far, this message included
    logprobs: tuple[TokenLogprob, ...] = ()  # with sampling.logprobs: the returned text's tokens
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # with sampling.prompt_logprobs: once, complete

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer, request: ValidRequest) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=request.skip_special_tokens)
        self._stop = StopStringMatcher(request.stop, include_stop_str_in_output=request.include_stop_str_in_output)
        self._stop_token_ids = set(request.sampling.stop_token_ids)
        self._stop_token_in_text = request.include_stop_str_in_output
        self._num_tokens = 0
        token_text = TokenText(tokenizer)
        self._logprobs = OutputLogprobs(token_text) if request.sampling.logprobs is not None else None
        self._prompt_logprobs = None if request.sampling.prompt_logprobs is None else PromptLogprobsCollector(
            request.prompt_token_ids, token_text, lambda ids: token_pieces(tokenizer, ids))

    def on_tokens(self, token_ids: Sequence[int], finish_reason: FinishReason | None,
                  logprobs: Sequence[Logprobs] = (), prompt_logprobs: PromptLogprobs | None = None) -> Output:
        """Feed one upstream event; `finish_reason` is set on the scheduler's last event."""
        ids = tuple(token_ids)  # a proto's repeated field: copied once, here
        self._num_tokens += len(ids)
        # the scheduler stopped the request on its last token: a stop token, kept out of the text
        hide_last = finish_reason is FinishReason.STOP and bool(ids) and not self._stop_token_in_text
        text = self._decode(ids, finish_reason is not None, logprobs, hide_last)
        safe = self._stop.feed(text)
        if self._stop.stopped:
            out = Output(safe, ids, FinishReason.STOP, self._stop.matched_stop, self._num_tokens)
        elif finish_reason is None:
            out = Output(safe, ids, num_output_tokens=self._num_tokens)
        else:
            tail = safe + self._stop.finish()
            stop_reason = str(ids[-1]) if ids and ids[-1] in self._stop_token_ids else ""
            out = Output(tail, ids, finish_reason, stop_reason, self._num_tokens)
        if self._logprobs is None and self._prompt_logprobs is None:
            return out
        return self._with_logprobs(out, prompt_logprobs)

    def _decode(self, ids: tuple[int, ...], finished: bool, logprobs: Sequence[Logprobs], hide_last: bool) -> str:
        """The new text (without the last token's with `hide_last`); with logprobs, token by
        token so each token gets its own piece (a hidden token's piece is empty)."""
        shown = ids[:-1] if hide_last else ids
        if self._logprobs is None:
            return self._detok.append(shown) + (self._detok.finish() if finished else "")
        pieces = [self._detok.append((t,)) for t in shown]
        tail = self._detok.finish() if finished else ""
        if pieces:
            pieces[-1] += tail
        if hide_last:
            pieces.append("" if pieces or not tail else tail)
        self._logprobs.add(ids, pieces, logprobs)
        return "".join(pieces) if pieces else tail

    def _with_logprobs(self, out: Output, prompt_part: PromptLogprobs | None) -> Output:
        lp = () if self._logprobs is None else self._logprobs.release(out.text, out.finished, self._stop.stopped)
        prompt = None
        if self._prompt_logprobs is not None:
            if prompt_part is not None:
                self._prompt_logprobs.add(prompt_part.start, prompt_part.entries)
            prompt = self._prompt_logprobs.take()
        return out._replace(logprobs=lp, prompt_logprobs=prompt)


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's share of `decode(ids)` (special tokens kept): the incremental
    detokenizer fed one token at a time; a token inside a UTF-8 character gets ''."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    pieces = [detok.append((t,)) for t in ids]
    if pieces:
        pieces[-1] += detok.finish()
    return pieces
