"""Per-request output processing in the gateway (pure domain code, no grpc).

Committed token ids in → text deltas out: incremental detokenization (never broken UTF-8,
deltas concatenate to `tokenizer.decode(output)`), then stop strings matched across token
boundaries. When a stop string matches, the request is finished here and the caller
aborts it upstream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher
from gateway.validation import ValidRequest
from stepahead.plan import FinishReason


@dataclass(frozen=True)
class Output:
    """What to send the client for one upstream event."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_reason: str = ""  # the stop string, or the stop token id, that ended the request
    num_output_tokens: int = 0  # tokens sent so far, this message included

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer, request: ValidRequest) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=request.skip_special_tokens)
        self._stop = StopStringMatcher(request.stop, include_stop_str_in_output=request.include_stop_str_in_output)
        self._stop_token_ids = set(request.sampling.stop_token_ids)
        self._num_tokens = 0

    def on_tokens(self, token_ids: Sequence[int], finish_reason: FinishReason | None) -> Output:
        """Feed one upstream event; `finish_reason` is set on the scheduler's last event."""
        ids = tuple(token_ids)
        self._num_tokens += len(ids)
        text = self._detok.append(ids)
        if finish_reason is not None:
            text += self._detok.finish()
        safe = self._stop.feed(text)
        if self._stop.stopped:
            return Output(safe, ids, FinishReason.STOP, self._stop.matched_stop, self._num_tokens)
        if finish_reason is None:
            return Output(safe, ids, num_output_tokens=self._num_tokens)
        tail = safe + self._stop.finish()
        stop_reason = str(ids[-1]) if ids and ids[-1] in self._stop_token_ids else ""
        return Output(tail, ids, finish_reason, stop_reason, self._num_tokens)
