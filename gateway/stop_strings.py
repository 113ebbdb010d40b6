"""Stop strings over streamed text: find them across delta boundaries, never leak a prefix.

Pure Python (no torch, no grpc). One `StopStringMatcher` per request sits between the
incremental detokenizer and the client: every text delta goes through `feed`, which returns
the part that is safe to send now. A suffix that could still grow into a stop string is held
back (so a client never sees a partial stop string); `finish` flushes it when generation
ends for another reason.

Which stop wins: the occurrence that *completes* first in the full text (smallest end
index); among occurrences that end at the same index, the longest. That is what a stream
can decide the moment the text arrives, and it does not depend on how the text was split
into deltas. The final text is the full text cut before the stop string (or after it with
`include_stop_str_in_output`).
"""

from __future__ import annotations

from collections.abc import Sequence


def _validated(stop_strings: Sequence[str]) -> tuple[str, ...]:
    if isinstance(stop_strings, str):
        raise TypeError(f"stop strings must be a sequence of strings, not the string {stop_strings!r}")
    stops = tuple(stop_strings)
    for stop in stops:
        if not isinstance(stop, str):
            raise TypeError(f"stop strings must be strings, got {stop!r}")
        if not stop:
            raise ValueError("stop strings must be non-empty")
    return stops


def find_first_stop(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(start index, stop string) of the occurrence that ends first, longest on ties; or None."""
    best: tuple[int, int, str] | None = None  # (end, start, stop): min end, then min start
    for stop in stop_strings:
        start = text.find(stop)  # a string's first occurrence is also its first to end
        if start >= 0:
            candidate = (start + len(stop), start, stop)
            best = candidate if best is None else min(best, candidate)
    return None if best is None else (best[1], best[2])


class StopStringMatcher:
    """Streams text for one request, stopping at the first stop string."""

    def __init__(self, stop_strings: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        self._stops = _validated(stop_strings)
        self._include = include_stop_str_in_output
        # Every proper prefix of every stop string: what a held-back suffix may be.
        self._prefixes = {stop[:k] for stop in self._stops for k in range(1, len(stop))}
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._pending = ""  # received but not yet emitted (a possible stop-string start)
        self._emitted: list[str] = []
        self._matched: str | None = None
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string was found: generation should stop, `text` is final."""
        return self._matched is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text, if any."""
        return self._matched

    @property
    def text(self) -> str:
        """Everything emitted so far; once stopped or finished, the final (truncated) text."""
        return "".join(self._emitted)

    def feed(self, delta: str) -> str:
        """Take the next text delta; return the text that is safe to send now (maybe "")."""
        if not isinstance(delta, str):
            raise TypeError(f"text delta must be a string, got {delta!r}")
        if self._finished or self.stopped:
            raise RuntimeError("StopStringMatcher.feed called after the text was stopped or finished")
        if not self._stops:  # nothing to match or hold back
            return self._emit(delta)
        buffer = self._pending + delta
        match = find_first_stop(buffer, self._stops)
        if match is not None:
            start, stop = match
            self._matched = stop
            self._pending = ""
            return self._emit(buffer[: start + len(stop)] if self._include else buffer[:start])
        hold = self._held_suffix_length(buffer)
        self._pending = buffer[len(buffer) - hold :]
        return self._emit(buffer[: len(buffer) - hold])

    def finish(self) -> str:
        """Generation ended without a stop string: release the held-back text."""
        if self._finished:
            raise RuntimeError("StopStringMatcher.finish called twice")
        self._finished = True
        released, self._pending = self._pending, ""
        return self._emit(released)

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text

    def _held_suffix_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        for length in range(min(len(buffer), self._max_hold), 0, -1):
            if buffer[-length:] in self._prefixes:
                return length
        return 0
