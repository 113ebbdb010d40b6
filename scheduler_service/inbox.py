"""The engine's inbox: what reaches the engine, and the order it takes it in.

The engine runs on one asyncio event loop (the daemon's, which also owns every gRPC
stream). Code on that loop (a gateway stream's reader, a worker stream's reader, the
servicer's calls) puts items here directly: no thread hand-off, no lock. Another thread
(a test, the /metrics endpoint) puts them through `loop.call_soon_threadsafe`, so the
engine's state still has one owner. Worker results and losses come as `links.WorkerResult`
and `links.WorkerLost`; the rest are the items below.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.links import GatewaySession, Wakeup, WorkerHandle
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
    reply: concurrent.futures.Future


@dataclass(frozen=True)
class CloseSession:
    session: object


class Stop:
    pass


class Inbox:
    """A deque the engine's coroutine takes from, with the engine's rule for taking: each
    round, what it held when the engine woke, not what arrives meanwhile, so a flood of
    submissions never keeps a device with room from its next plan.

    Before `bind` (the engine has not started) any thread may `put`; the items wait."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._wakeup = Wakeup()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._timer: asyncio.TimerHandle | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The engine's loop takes from now on (called on that loop's thread)."""
        self._loop, self._thread = loop, threading.get_ident()

    def on_loop(self) -> bool:
        """True on the engine loop's thread."""
        return threading.get_ident() == self._thread

    def put(self, item) -> None:
        """Queue `item` (any thread)."""
        if self._thread is None or threading.get_ident() == self._thread:
            self._put_here(item)
        else:
            self._loop.call_soon_threadsafe(self._put_here, item)

    def _put_here(self, item) -> None:
        self._items.append(item)
        self._wakeup.set()

    def _wake(self) -> None:
        self._timer = None
        self._wakeup.set()

    async def next_round(self, deadline: float | None) -> list:
        """Wait for an item (or until `deadline`, on the loop's clock); then it and every item
        queued behind it now. [] when the deadline came first. Yields to the loop at least
        once, so the writers woken by the last round run before the next one."""
        items = self._items
        if items:
            await asyncio.sleep(0)
        else:
            loop = self._loop
            if deadline is not None:  # one timer, at or before the earliest deadline (an early wake is harmless)
                timer = self._timer
                if timer is None or timer.when() > deadline:
                    if timer is not None:
                        timer.cancel()
                    self._timer = loop.call_at(deadline, self._wake)
            await self._wakeup.wait(loop)
        n = len(items)
        return [items.popleft() for _ in range(n)]
