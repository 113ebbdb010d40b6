"""The scheduler's links to its peers, as domain objects (no grpc): the plan outbox and
handle of one attached worker, one gateway's session, and what the engine refuses.

The servicer owns the streams; these objects carry plans down, results and losses up (to
the engine's inbox), and event batches to a gateway's writer. In the daemon every stream
and the engine run on one asyncio event loop: a `LoopOutbox` and a session's `batches()`
are read by coroutines on that loop and woken by the engine with no thread hand-off. A
`PlanOutbox` and a session's plain iteration serve a reader on another thread (tests,
benchmarks that drive the engine without gRPC).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import queue
import threading
from dataclasses import dataclass

from scheduler_service.core.request import QueueFull
from stepahead.plan import GrammarReady, KVLoaded, StepPlan, StepResult, WorkerInfo


class NoWorker(RuntimeError):
    """No worker ever attached, so the model's limits are not known yet."""


class WorkerRefused(Exception):
    """Why the scheduler closed (or would not open) a worker's stream."""

    class Kind(enum.Enum):
        INVALID = "invalid"  # the worker sent something the protocol does not allow
        MISMATCH = "mismatch"  # the worker serves another model or geometry than the other replicas

    def __init__(self, kind: WorkerRefused.Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Handoff:
    """A one-shot signal from the writer to the engine: the plan was written. Built on one
    C-level lock: a `threading.Event` is a Python-level Condition, whose `set` and `wait` run
    Python while holding the GIL, once per step on the critical chain."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """True once set (it stays set), False when `timeout` passed first."""
        if not self._lock.acquire(timeout=timeout):
            return False
        self._lock.release()
        return True


class PlanOutbox:
    """Plans from the engine to a thread that writes the worker's stream (tests, benchmarks;
    the daemon's writer is a coroutine on the engine's loop: `LoopOutbox`).

    `send` returns once the stream asked for the message after the plan (i.e. the plan was
    written), or after `handoff_timeout_s`: the engine serves clients only after the
    device's next step is on its way, instead of racing 64 client threads for the GIL.
    `close(error)` ends the stream; `error` (a `WorkerRefused`) is what the writer reports.
    `accept()` (the engine made the worker a replica) runs `on_accept` on the writer's
    thread, before any plan: the servicer tells the worker there.
    """

    _ACCEPTED = object()

    def __init__(self, handoff_timeout_s: float = 0.05, on_accept=lambda: None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # C-level: the hand-off costs no Python
        self.handoff_timeout_s = handoff_timeout_s
        self._on_accept = on_accept
        self.error: WorkerRefused | None = None

    def accept(self) -> None:
        self._queue.put(self._ACCEPTED)

    def send(self, plan: StepPlan) -> None:
        self.post(plan).wait(self.handoff_timeout_s)

    def post(self, plan: StepPlan) -> Handoff:
        """Queue the plan; the handoff is set once it was written (a group's ranks wait together)."""
        written = Handoff()
        self._queue.put((plan, written))
        return written

    def close(self, error: WorkerRefused | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self._queue.put(None)

    def __iter__(self):
        while (item := self._queue.get()) is not None:
            if item is self._ACCEPTED:
                self._on_accept()
                continue
            plan, written = item
            yield plan
            written.set()  # the consumer came back for the next one: this one is out


class _Written:
    """`post`'s answer for a plan that is written by a coroutine on the engine's own loop:
    nothing to wait for (the loop runs the writer as soon as the engine's round yields)."""

    __slots__ = ()

    @staticmethod
    def wait(timeout: float) -> bool:
        return True


WRITTEN = _Written()


class Wakeup:
    """The one coroutine of an asyncio loop that waits for more work (a stream's writer, the
    engine): `wait` parks it until `set`, which the loop's other code calls after adding work."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future | None = None

    @property
    def waiting(self) -> bool:
        return self._future is not None

    def set(self) -> None:
        future = self._future
        if future is not None:
            self._future = None
            if not future.done():
                future.set_result(None)

    async def wait(self, loop: asyncio.AbstractEventLoop) -> None:
        self._future = loop.create_future()
        await self._future


class LoopOutbox:
    """Plans from the engine to the coroutine that writes the worker's stream, both on the
    engine's event loop: `send` queues the plan and wakes the writer, which runs as soon as
    the engine's round yields (before the gateway writers the same round woke: the loop
    runs ready callbacks in order, and the plan is sent before clients are served).

    The writer iterates `async for item in outbox`: `ACCEPTED` once the engine made the
    worker a replica (the servicer tells the worker), then plans; the iteration ends at
    `close(error)`, whose `error` (a `WorkerRefused`) is what the writer reports."""

    ACCEPTED = PlanOutbox._ACCEPTED
    handoff_timeout_s = 0.0  # a group's FanOutbox reads it; nothing waits here

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._wakeup = Wakeup()
        self.error: WorkerRefused | None = None

    def _push(self, item) -> None:
        self._items.append(item)
        self._wakeup.set()

    def accept(self) -> None:
        self._push(self.ACCEPTED)

    def send(self, plan: StepPlan) -> None:
        self._push(plan)

    def post(self, plan: StepPlan) -> _Written:
        self._push(plan)
        return WRITTEN

    def close(self, error: WorkerRefused | None = None) -> None:
        """End the writer (on the loop: the engine, or the call's end)."""
        if error is not None and self.error is None:
            self.error = error
        self._push(None)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        items = self._items
        while True:
            while not items:
                await self._wakeup.wait(asyncio.get_running_loop())
            item = items.popleft()
            if item is None:
                return
            yield item


class WorkerHandle:
    """One attached worker's link: plans go out through `outbox.send`; `outbox.close` ends it.
    `deliver` is the engine's inbox: results and the loss are queued there, in order."""

    def __init__(self, deliver, info: WorkerInfo, outbox: PlanOutbox) -> None:
        self._deliver, self.info, self.outbox = deliver, info, outbox

    def on_result(self, result: StepResult) -> None:
        self._deliver(WorkerResult(self, result))

    def on_lost(self, reason: str, error: WorkerRefused | None = None, clean: bool = False) -> None:
        self._deliver(WorkerLost(self, reason, error, clean))

    def on_kv_loaded(self, loaded: KVLoaded) -> None:
        self._deliver(WorkerKVLoaded(self, loaded))

    def on_grammar_ready(self, ready: GrammarReady) -> None:
        self._deliver(WorkerGrammarReady(self, ready))


@dataclass(frozen=True)
class WorkerResult:
    handle: WorkerHandle
    result: StepResult


@dataclass(frozen=True)
class WorkerKVLoaded:
    handle: WorkerHandle
    loaded: KVLoaded


@dataclass(frozen=True)
class WorkerGrammarReady:
    handle: WorkerHandle
    ready: GrammarReady


@dataclass(frozen=True)
class WorkerLost:
    handle: WorkerHandle
    reason: str
    error: WorkerRefused | None = None
    clean: bool = False  # the worker closed its stream itself (e.g. it is shutting down)


class RejectCode(enum.Enum):
    INVALID = "invalid"  # the request can never be served
    UNAVAILABLE = "unavailable"  # no worker attached yet: retry later
    QUEUE_FULL = "queue_full"  # --max-queued-requests reached: retry later


@dataclass(frozen=True)
class Rejected:
    """A submission on a gateway session that the scheduler refused."""

    request_id: str  # scoped, like the engine's (the session's writer cuts the scope off)
    message: str
    code: RejectCode = RejectCode.INVALID


def rejection(request_id: str, exc: Exception) -> Rejected:
    """The answer to a refused submission: QueueFull and NoWorker may be retried later, any
    other refusal (RequestRejected: the request itself) may not."""
    code = (RejectCode.QUEUE_FULL if isinstance(exc, QueueFull)
            else RejectCode.UNAVAILABLE if isinstance(exc, NoWorker) else RejectCode.INVALID)
    return Rejected(request_id, str(exc), code)


class GatewaySession:
    """Every request one gateway submitted on its Connect stream: the engine hands over one
    list of events per dispatch; the stream's writer merges lists that queued up meanwhile
    (and `event_batches` encodes a merged list, split where a request's order needs it).

    At most `max_unhandled` of its submissions wait in the engine's inbox at once: the
    stream's reader waits for room before the next one (`Engine.submit_async` on the loop,
    `Engine.submit` blocking another thread), so gRPC's flow control pushes back on a peer
    that submits faster than the engine takes them, and a flood holds no more memory than
    that.

    The daemon's writer is a coroutine on the engine's loop (`batches()`, woken by
    `put_many`); a thread may read it instead by plain iteration (tests)."""

    MAX_UNHANDLED = 4096

    def __init__(self, max_unhandled: int = MAX_UNHANDLED) -> None:
        self._batches: queue.SimpleQueue[list | None] = queue.SimpleQueue()
        self._room = threading.Semaphore(max_unhandled)
        self._room_waiters: collections.deque[asyncio.Future] = collections.deque()  # loop readers awaiting room
        self._wakeup = Wakeup()  # the loop writer, waiting for a batch
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop writer's (close() from another thread)
        # The gateway's SessionOptions.plain_token_steps: set by the stream's reader before its
        # first submission (so before the engine sees the session), read by the engine.
        self.plain_token_steps = 1
        self._held: list = []  # plain tokens of up to plain_token_steps steps (engine loop)
        self._held_steps = 0

    def reserve(self, blocking: bool = True) -> bool:
        """A submission is on its way to the engine: blocks while `max_unhandled` are (so
        never call it blocking on the engine's own thread); False when not `blocking` and
        there is no room."""
        return self._room.acquire(blocking)

    async def reserve_async(self) -> None:
        """`reserve` for a reader on the engine's loop: awaits room."""
        while not self._room.acquire(False):
            waiter = asyncio.get_running_loop().create_future()
            self._room_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._room_waiters:
                    self._room_waiters.remove(waiter)

    def handled(self) -> None:
        """The engine took one submission (added or refused): room for the next (engine loop)."""
        self._room.release()
        while self._room_waiters:  # wake one reader still waiting (a cancelled one's wake would be lost)
            waiter = self._room_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    def put_many(self, events: list) -> None:
        """Send `events` now, after any plain tokens held (engine loop)."""
        if self._held:
            events, self._held, self._held_steps = self._held + list(events), [], 0
        self._batches.put(list(events))
        if self._wakeup.waiting:
            self._wakeup.set()

    def hold_plain(self, parts: list) -> bool:
        """One step's plain tokens for this session (`events.PlainTokens` parts): held until
        `plain_token_steps` steps are, then sent together. True while some are held (engine
        thread; the engine sends them, `flush`, once it has no step in flight)."""
        self._held += parts
        self._held_steps += 1
        if self._held_steps >= self.plain_token_steps:
            self.flush()
        return bool(self._held)

    def flush(self) -> None:
        """Send the plain tokens held, if any (engine loop)."""
        if self._held:
            self.put_many([])

    def close(self) -> None:
        """End the writer (any thread: the call's end closes it too; the engine flushes first)."""
        self._batches.put(None)
        loop = self._loop
        if loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._wakeup.set()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(self._wakeup.set)

    async def batches(self):
        """The writer on the engine's loop: lists of events, those queued meanwhile merged."""
        self._loop = asyncio.get_running_loop()
        batches = self._batches
        while True:
            while batches.empty():
                await self._wakeup.wait(self._loop)
            batch = batches.get_nowait()
            if batch is None:
                return
            while not batches.empty():
                more = batches.get_nowait()
                if more is None:
                    yield batch
                    return
                batch += more
            yield batch

    def __iter__(self):
        while (batch := self._batches.get()) is not None:
            while True:
                try:
                    more = self._batches.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    yield batch
                    return
                batch += more
            yield batch
