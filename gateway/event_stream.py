"""How a request's scheduler events reach the asyncio code that streams them (both transports).

The scheduler link's reader thread calls a request's sink once per event. `LoopEvents` turns
those calls into puts on the request's `Mailbox` with one event-loop wake-up per burst
of events (one `call_soon_threadsafe`, i.e. one self-pipe write, per step's batch instead of
one per request per step). `choices()` is the consumer side both the gRPC servicer and the
HTTP server iterate: it merges the token events that queued up while the consumer was busy,
and applies the stream interval (`--stream-interval`, vLLM's flag: at most one message per
N tokens of a sequence, its first token and its end always at once).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable

from stepahead.v1 import scheduler_pb2


class Mailbox:
    """One request's events on its event loop, for its one consumer: the part of
    `asyncio.Queue` the merger uses (`put_nowait`, `get`, `empty`), without the queue's
    bookkeeping (task counts, put waiters) on the per-token path. Loop thread only."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled consumer's future stays cancelled
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    async def get(self) -> object:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class LoopEvents:
    """Sinks for one event loop's request queues, callable from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Mailbox | asyncio.Queue, object]] = []
        self._scheduled = False

    def sink(self, events: Mailbox | asyncio.Queue) -> Callable[[object], None]:
        def put(event: object) -> None:
            with self._lock:
                self._pending.append((events, event))
                if self._scheduled:
                    return  # the flush already asked for takes this event too
                self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:
                if not self._loop.is_closed():
                    raise
                # the server's loop is gone (shutdown): nobody is left to read the event

        return put

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for events, event in pending:
            events.put_nowait(event)


class EventMerger:
    """A request's events as the consumer can take them: token events of one upstream
    sequence that queued up while the consumer was busy come merged into one (their tokens
    in order, the last one's finish reason and counts), so a client that falls behind gets
    fewer, larger messages instead of one per scheduler step. With `stream_interval` N > 1,
    a sequence's tokens are also held until N of them are there (its first token and its
    final event are never held)."""

    def __init__(self, events: Mailbox | asyncio.Queue, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._events = events
        self._interval = stream_interval
        self._held = None  # an event taken while merging that belongs after the merged one
        self._started: set[str] = set()  # sequences whose first token went out

    async def next(self):
        event, self._held = (self._held, None) if self._held is not None else (await self._events.get(), None)
        if self._interval == 1 and self._events.empty():
            return event  # the usual case when the consumer keeps up: nothing to merge or hold
        while _mergeable(event):
            if self._events.empty() and self._due(event):
                break
            more = await self._events.get()
            if not _mergeable_into(event, more):
                self._held = more
                break
            event = _merged(event, more)
        if isinstance(event, scheduler_pb2.TokenEvent) and event.token_ids:
            self._started.add(event.request_id)
        return event

    def _due(self, event) -> bool:
        """Whether `event` goes out now rather than waiting for more of its sequence's tokens."""
        return (self._interval == 1 or len(event.token_ids) >= self._interval
                or event.request_id not in self._started)


def _merged(event, more):
    merged = scheduler_pb2.TokenEvent()
    merged.CopyFrom(more)
    merged.token_ids[:] = [*event.token_ids, *more.token_ids]
    if event.logprobs or more.logprobs:
        merged.ClearField("logprobs")
        merged.logprobs.extend([*event.logprobs, *more.logprobs])
    return merged


def _mergeable(event) -> bool:
    return isinstance(event, scheduler_pb2.TokenEvent) and not (event.finish_reason or event.rejected)


def _mergeable_into(event, more) -> bool:
    return (isinstance(more, scheduler_pb2.TokenEvent) and more.request_id == event.request_id and not more.rejected
            and not (event.prompt_logprobs or more.prompt_logprobs))  # prompt parts stay events of their own


async def choices(gen, events: Mailbox | asyncio.Queue, stream_interval: int = 1) -> AsyncIterator:
    """The `ChoiceOutput`s of `gen` (a `generation.Generation`) until it is done."""
    merger = EventMerger(events, stream_interval)
    while not gen.done:
        choice = gen.on_event(await merger.next())
        if choice is not None:
            yield choice
