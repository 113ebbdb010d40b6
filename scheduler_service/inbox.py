"""The engine's inbox: what other threads hand the engine thread, and the order it takes it in.

Every thread that talks to the engine (a gateway stream's reader, a worker stream's reader,
the servicer's calls) puts one item here; only the engine thread takes from it, so the
engine's state needs no lock. Worker results and losses come as `links.WorkerResult` and
`links.WorkerLost`; the rest are the items below.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.links import GatewaySession, WorkerHandle
from scheduler_service.core.request import Request


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Submit:
    request: Request
    session: GatewaySession


@dataclass(frozen=True)
class Attach:
    handle: WorkerHandle


@dataclass(frozen=True)
class Call:
    fn: Callable[[], object]
    reply: queue.SimpleQueue


@dataclass(frozen=True)
class CloseSession:
    session: object


class Stop:
    pass


class Inbox:
    """A C-level `queue.SimpleQueue` (no Python Condition per hand-off) with the engine's rule
    for taking from it: each round, what it held when the engine woke, not what arrives
    meanwhile, so a flood of submissions never keeps a device with room from its next plan."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.put = self._queue.put

    def next_round(self, timeout: float | None) -> list:
        """Wait up to `timeout` for an item; then it and every item queued behind it now (only
        the engine thread takes, so the counted backlog is there to take). [] on timeout."""
        try:
            first = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        return [first, *(self._queue.get_nowait() for _ in range(self._queue.qsize()))]
