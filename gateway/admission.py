"""Which new streams the gateway takes (pure domain code, no grpc).

`StreamGate` counts open streams: past `limit` a new one is refused at once (the servicer
answers RESOURCE_EXHAUSTED), and once draining every new one is refused (UNAVAILABLE)
while `drain()` waits for the open ones to finish. Nothing is ever dropped silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

RETRY_AFTER_S = "1"  # what a refused client is told to wait before trying again (429/503, gRPC trailers)


class Overloaded(Exception):
    """The gateway already serves its maximum number of concurrent streams."""


class Draining(Exception):
    """The gateway is shutting down and takes no new streams."""


class StreamGate:
    def __init__(self, limit: int, on_overloaded: Callable[[int], None] = lambda limit: None) -> None:
        """`on_overloaded(limit)`: a stream was refused for the limit (the daemon logs it, rate-limited:
        an overloaded gateway refuses many)."""
        if limit < 1:
            raise ValueError(f"the stream limit must be >= 1, got {limit}")
        self.limit = limit
        self._on_overloaded = on_overloaded
        self._active = 0
        self._draining = False
        self._idle = threading.Condition()

    @property
    def active(self) -> int:
        return self._active

    def enter(self) -> None:
        with self._idle:
            if self._draining:
                raise Draining("the gateway is shutting down; retry on another gateway")
            if self._active < self.limit:
                self._active += 1
                return
        self._on_overloaded(self.limit)
        raise Overloaded(f"the gateway is at its limit of {self.limit} concurrent streams "
                         "(--max-concurrent-streams); retry later")

    def leave(self) -> None:
        with self._idle:
            self._active -= 1
            if self._active == 0:
                self._idle.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Refuse new streams; wait until the open ones ended (True) or `timeout_s` passed."""
        with self._idle:
            self._draining = True
            return self._idle.wait_for(lambda: self._active == 0, timeout=timeout_s)
