"""How a request's scheduler events reach the asyncio code that streams them (both transports).

The scheduler link calls a request's sink once per event, on the link's event loop (the
gRPC server's). `LoopEvents` turns those calls into puts on the request's `Mailbox`: at once
when the sink is called on the mailbox's own loop (the gateway runs both transports and
the links on one loop, so this is the rule), and otherwise, from another thread, with one
event-loop wake-up per burst of events (one `call_soon_threadsafe`, i.e. one
self-pipe write, per step's batch instead of one per request per step). `choices()` is the consumer side both the gRPC servicer and the
HTTP server iterate: it merges the token events that queued up while the consumer was busy,
and applies the stream interval (`--stream-interval`, vLLM's flag: at most one message per
N tokens of a sequence, its first token and its end always at once).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from gateway.plain_tokens import TOKEN_EVENTS
from stepahead.v1 import scheduler_pb2


class Mailbox:
    """One request's events on its event loop, for its one consumer: `put_nowait`, `get`,
    `get_nowait`, `empty` like `asyncio.Queue`, without the queue's bookkeeping (task counts,
    put waiters) on the per-token path; and `wait_tokens`, which sleeps until enough of a
    sequence's tokens are queued (the stream interval), so a consumer holding tokens is not
    woken once per token. Loop thread only."""

    __slots__ = ("_items", "_waiter", "_hold_for", "_hold_tokens")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._hold_for = None  # with wait_tokens: the event whose sequence's tokens are awaited
        self._hold_tokens = 0  # ... and how many more of them are needed

    def put_nowait(self, item: object) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is None:
            return
        if self._hold_for is not None and _mergeable(item) and _mergeable_into(self._hold_for, item):
            self._hold_tokens -= len(item.token_ids)
            if self._hold_tokens > 0:
                return  # more of the same sequence, not enough yet: the consumer sleeps on
        self._waiter = None
        if not waiter.done():  # a cancelled consumer's future stays cancelled
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> object:
        return self._items.popleft()

    async def get(self) -> object:
        while not self._items:
            await self._wait()
        return self._items.popleft()

    async def wait_tokens(self, event, count: int) -> None:
        """Return once `count` more tokens of `event`'s sequence are queued, or anything
        that ends its merge (its final event, another sequence's event, a wake-up)."""
        self._hold_for, self._hold_tokens = event, count
        try:
            while self._hold_for is not None and not self._items:
                await self._wait()
        finally:
            self._hold_for = None

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


class LoopEvents:
    """Sinks for one event loop's request queues, callable from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Mailbox, object]] = []
        self._scheduled = False

    def sink(self, events: Mailbox) -> Callable[[object], None]:
        def put(event: object) -> None:
            if not self._pending and asyncio._get_running_loop() is self._loop:
                # On the mailbox's own loop with nothing from another thread before it (read
                # without the lock: another thread's append is atomic, and one that lands after
                # this check was not before this event): the usual case, no lock.
                events.put_nowait(event)
                return
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

    def __init__(self, events: Mailbox, stream_interval: int = 1) -> None:
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
        run = [event]
        while _mergeable(run[-1]):
            if self._events.empty():
                missing = self._missing(run)
                if missing <= 0:
                    break
                await self._events.wait_tokens(run[-1], missing)
                continue
            more = self._events.get_nowait()
            if not _mergeable_into(run[-1], more):
                self._held = more
                break
            run.append(more)
        event = run[0] if len(run) == 1 else _merged(run)
        if self._interval > 1 and isinstance(event, TOKEN_EVENTS) and event.token_ids:
            self._started.add(event.request_id)
        return event

    def _missing(self, run: list) -> int:
        """Tokens the run still needs before it goes out (<= 0: now)."""
        if self._interval == 1 or run[0].request_id not in self._started:
            return 0  # its first token is never held
        return self._interval - sum(len(e.token_ids) for e in run)


def _merged(run: list):
    """One event of a run of one sequence's token events: their tokens (and logprobs) in order,
    the last one's finish reason and counts."""
    last = run[-1]
    merged = scheduler_pb2.TokenEvent()
    merged.CopyFrom(last if isinstance(last, scheduler_pb2.TokenEvent) else last.to_proto())
    merged.token_ids[:] = [t for e in run for t in e.token_ids]
    if any(e.logprobs for e in run):
        merged.ClearField("logprobs")
        merged.logprobs.extend([lp for e in run for lp in e.logprobs])
    return merged


def _mergeable(event) -> bool:
    return isinstance(event, TOKEN_EVENTS) and not (event.finish_reason or event.rejected)


def _mergeable_into(event, more) -> bool:
    return (isinstance(more, TOKEN_EVENTS) and more.request_id == event.request_id and not more.rejected
            and not (event.prompt_logprobs or more.prompt_logprobs))  # prompt parts stay events of their own


async def choices(gen, events: Mailbox, stream_interval: int = 1) -> AsyncIterator:
    """The `ChoiceOutput`s of `gen` (a `generation.Generation`) until it is done."""
    merger = EventMerger(events, stream_interval)
    while not gen.done:
        choice = gen.on_event(await merger.next())
        if choice is not None:
            gen.delivered(choice)
            yield choice


def batch_choices(gens: Sequence, events: Mailbox, stream_interval: int = 1) -> AsyncIterator:
    """The `ChoiceOutput`s of a batch's generations (one per prompt, all sinking into
    `events`) until all are done, in arrival order; prompt i's choice j comes as index
    `i * n + j`. The first error (a rejection, a broken link) ends the iteration: the caller
    aborts the batch. One generation: `choices` itself (no extra hop per token)."""
    if len(gens) == 1:
        return choices(gens[0], events, stream_interval)
    return _batch_choices(gens, events, stream_interval)


async def _batch_choices(gens: Sequence, events: Mailbox, stream_interval: int) -> AsyncIterator:
    owner = {rid: (gen, i * gen.valid.n) for i, gen in enumerate(gens) for rid in gen.upstream_ids}
    merger = EventMerger(events, stream_interval)
    while not all(gen.done for gen in gens):
        event = await merger.next()
        if not isinstance(event, TOKEN_EVENTS):  # a wake-up or a broken link: every generation's
            for gen in gens:
                gen.on_event(event)
            continue
        gen, offset = owner[event.request_id]
        choice = gen.on_event(event)
        if choice is not None:
            gen.delivered(choice)
            yield choice._replace(index=choice.index + offset)
