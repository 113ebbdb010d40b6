"""The scheduler daemon's engine loop: drives the scheduler core against one worker.

Pure domain code (no grpc): the servicer hands it submissions, aborts, the worker's hello
and step results; it hands plans to a `send` callable and request events to per-request
streams. One engine thread owns the scheduler core; every other thread talks to it
through the inbox queue, so the core needs no locks.

The loop keeps up to `max_concurrent_batches` plans in flight (1 in synchronous mode):
it schedules and sends step t+1 before the result of step t is back, then commits
results in plan order.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.config import SchedulerConfig
from scheduler_service.request import Request
from scheduler_service.scheduler import FinishReason, RequestEvent, RequestRejected, Scheduler
from scheduler_service.metrics import SchedulerMetrics
from stepahead.flight_recorder import FlightRecorder, StepRecord
from stepahead.plan import StepPlan, StepResult, WorkerInfo


class NoWorker(RuntimeError):
    """No worker is attached, so the model's limits are not known yet."""


@dataclass(frozen=True)
class _Abort:
    request_id: str


class WorkerRefused(Exception):
    """Why the scheduler closed (or would not open) a worker's stream."""

    class Kind(enum.Enum):
        INVALID = "invalid"  # the worker sent something the protocol does not allow
        ALREADY_ATTACHED = "already_attached"  # another worker holds this scheduler

    def __init__(self, kind: WorkerRefused.Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class PlanOutbox:
    """Plans from the engine thread to the thread that writes the worker's stream.

    `send` returns once the stream asked for the message after the plan (i.e. the plan was
    written), or after `handoff_timeout_s`: the engine serves clients only after the
    device's next step is on its way, instead of racing 64 client threads for the GIL.
    `close(error)` ends the stream; `error` (a `WorkerRefused`) is what the writer reports.
    """

    def __init__(self, handoff_timeout_s: float = 0.05) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._timeout = handoff_timeout_s
        self.error: WorkerRefused | None = None

    def send(self, plan: StepPlan) -> None:
        written = threading.Event()
        self._queue.put((plan, written))
        written.wait(self._timeout)

    def close(self, error: WorkerRefused | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self._queue.put(None)

    def __iter__(self):
        while (item := self._queue.get()) is not None:
            plan, written = item
            yield plan
            written.set()  # the consumer came back for the next one: this one is out


class WorkerHandle:
    """One attached worker's link: plans go out through `outbox.send`; `outbox.close` ends it."""

    def __init__(self, engine: Engine, info: WorkerInfo, outbox: PlanOutbox) -> None:
        self.engine, self.info, self.outbox = engine, info, outbox

    def on_result(self, result: StepResult) -> None:
        self.engine._inbox.put(_Result(self, result))

    def on_lost(self, reason: str, error: WorkerRefused | None = None, clean: bool = False) -> None:
        self.engine._inbox.put(_WorkerLost(self, reason, error, clean))


@dataclass(frozen=True)
class _Attach:
    handle: WorkerHandle


@dataclass(frozen=True)
class _Result:
    handle: WorkerHandle
    result: StepResult


@dataclass(frozen=True)
class _WorkerLost:
    handle: WorkerHandle
    reason: str
    error: WorkerRefused | None = None
    clean: bool = False  # the worker closed its stream itself (e.g. it is shutting down)


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], object]
    reply: queue.Queue


@dataclass(frozen=True)
class _CloseSession:
    session: object


class _Stop:
    pass


class RejectCode(enum.Enum):
    INVALID = "invalid"  # the request can never be served
    UNAVAILABLE = "unavailable"  # no worker attached yet: retry later
    QUEUE_FULL = "queue_full"  # --max-queued-requests reached: retry later


@dataclass(frozen=True)
class Rejected:
    """A submission on a gateway session that the scheduler refused."""

    request_id: str
    message: str
    code: RejectCode = RejectCode.INVALID


class GatewaySession:
    """Every request one gateway submitted on its Connect stream: the engine hands over one
    list of events per dispatch; the stream's writer merges lists that queued up meanwhile."""

    def __init__(self) -> None:
        self._batches: queue.Queue[list | None] = queue.Queue()

    def put_many(self, events: list) -> None:
        self._batches.put(list(events))

    def close(self) -> None:
        self._batches.put(None)

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


class Engine:
    """Owns the scheduler core and its in-flight plans; runs on its own thread."""

    def __init__(
        self,
        make_config: Callable[[WorkerInfo], SchedulerConfig],
        log,
        on_ready_change: Callable[[bool], None] = lambda ready: None,
        recorder: FlightRecorder | None = None,
        on_fatal: Callable[[], None] = lambda: None,
        metrics: SchedulerMetrics | None = None,
    ) -> None:
        self.metrics = metrics or SchedulerMetrics()
        self._on_fatal = on_fatal
        self.crashed = False
        self.recorder = recorder or FlightRecorder()
        self._make_config = make_config
        self._log = log
        self._on_ready_change = on_ready_change
        self._inbox: queue.Queue = queue.Queue()
        self._scheduler: Scheduler | None = None
        self._worker: WorkerHandle | None = None
        self._in_flight: collections.deque[StepPlan] = collections.deque()
        self._streams: dict[str, GatewaySession] = {}  # request id -> the session it came on
        self._carried_counts: collections.Counter = collections.Counter()  # of cores of lost workers
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---- thread-safe entry points -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(_Stop())
        self._thread.join(timeout=5)

    @property
    def worker(self) -> WorkerInfo | None:
        handle = self._worker
        return handle.info if handle else None

    def submit(self, request: Request, session: GatewaySession) -> None:
        """Queue a request whose events go to `session`; raises RequestRejected or NoWorker."""
        self._call(lambda: self._add(request, session))

    def close_session(self, session: GatewaySession) -> None:
        """The gateway's stream ended: abort every request it still has, then close."""
        self._inbox.put(_CloseSession(session))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def attach_worker(self, info: WorkerInfo, outbox: PlanOutbox) -> WorkerHandle:
        handle = WorkerHandle(self, info, outbox)
        self._inbox.put(_Attach(handle))
        return handle

    @property
    def carried_counts(self) -> collections.Counter:
        """Counters of the cores of workers lost so far (they continue in the next core)."""
        return self._carried_counts

    def stats(self):
        """The core's stats, read on the engine thread (None until a worker attached)."""
        return self._call(lambda: self._scheduler.stats() if self._scheduler else None)

    def _call(self, fn: Callable[[], object]) -> object:
        """Run fn on the engine thread and return its result (or raise its exception)."""
        reply: queue.Queue = queue.Queue(maxsize=1)
        self._inbox.put(_Call(fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    # ---- engine thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            self.crashed = True
            self._log.exception("engine_crashed")
            self._on_fatal()
            raise

    def _loop(self) -> None:
        while True:
            item = self._inbox.get()
            if isinstance(item, _Stop):
                return
            self._handle(item)
            while True:  # drain what else arrived before planning
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Stop):
                    return
                self._handle(item)
            self._pump()

    def _handle(self, item) -> None:
        match item:
            case _Abort(request_id):
                self._abort(request_id)
            case _Result(handle, result):
                if handle is self._worker:  # late results of a dropped worker mean nothing
                    self._commit(result)
            case _Attach(handle):
                self._attach(handle)
            case _WorkerLost(handle, reason, error, clean):
                if handle is self._worker:
                    self._lose_worker(reason, error, clean)
            case _CloseSession(session):
                for request_id in [rid for rid, sink in self._streams.items() if sink is session]:
                    self._abort(request_id)
                session.close()
            case _Call(fn, reply):
                try:
                    reply.put((True, fn()))
                except Exception as exc:  # handed to the caller, never swallowed
                    reply.put((False, exc))
            case _:
                raise AssertionError(f"unknown inbox item {item!r}")

    def _add(self, request: Request, stream: GatewaySession) -> None:
        """Runs on the engine thread; RequestRejected reaches the submitting caller."""
        if self._scheduler is None:
            raise NoWorker("no worker attached yet")
        if request.request_id in self._streams:
            raise RequestRejected("request_id: a request with this id is already in flight on this stream")
        self._scheduler.add_request(request)
        self._streams[request.request_id] = stream
        self.metrics.on_submit(request.request_id)

    def _abort(self, request_id: str) -> None:
        if self._scheduler is None:
            return
        event = self._scheduler.abort(request_id)
        if event is not None:
            self.metrics.on_events([event])
            self._dispatch([event])

    def _attach(self, handle: WorkerHandle) -> None:
        """One worker at a time: a second one is refused (it retries), never swapped in, so
        two workers cannot evict each other and a copied hello cannot take over."""
        if self._worker is not None:
            self._log.warning("worker_refused", attached=self._worker.info.worker_id, new=handle.info.worker_id)
            handle.outbox.close(WorkerRefused(WorkerRefused.Kind.ALREADY_ATTACHED, (
                f"worker {self._worker.info.worker_id!r} is attached; this scheduler drives one worker")))
            return
        try:
            scheduler = Scheduler(self._make_config(handle.info), counters=self._carried_counts)
        except ValueError as exc:  # the hello's geometry does not fit the scheduler's flags
            handle.outbox.close(WorkerRefused(WorkerRefused.Kind.INVALID, f"hello: {exc}"))
            return
        self._scheduler, self._worker = scheduler, handle
        self.metrics.on_worker(attached=True)
        self._log.info("worker_attached", **dataclasses.asdict(handle.info))
        self._on_ready_change(True)

    def _lose_worker(self, reason: str, error: WorkerRefused | None = None, clean: bool = False) -> None:
        """Fail every request (their KV lived on the lost worker) and close its stream."""
        assert self._worker is not None
        log = self._log.info if clean and not self._streams else self._log.error
        log("worker_detached" if clean else "worker_lost", reason=reason, requests=len(self._streams))
        self._on_ready_change(False)  # not serving before anyone hears of the loss
        self._carried_counts = self._scheduler.counters()  # totals go on with the next worker
        worker, self._scheduler, self._worker = self._worker, None, None
        self._in_flight.clear()
        worker.outbox.close(error)
        self.metrics.on_worker(attached=False, lost=not clean)
        message = f"the worker was lost: {reason}"
        events = [RequestEvent(rid, (), FinishReason.ERROR, 0, 0, message) for rid in self._streams]
        self.metrics.on_events(events)  # counted, and forgotten by the metrics too
        self._dispatch(events)

    def _pump(self) -> None:
        """Plan and send steps while the in-flight window has room."""
        sched = self._scheduler
        while sched is not None and sched.can_schedule():
            start = time.time()
            plan = sched.schedule()
            if plan is None:
                return
            record = self._record(plan, start)
            self._in_flight.append(plan)
            self._worker.outbox.send(plan)
            record.plan_sent = time.time()

    def _record(self, plan: StepPlan, start: float) -> StepRecord:
        stats = self._scheduler.stats()
        record = StepRecord(
            step_id=plan.step_id, schedule_start=start, schedule_end=time.time(),
            num_requests=plan.num_requests, num_tokens=plan.num_scheduled_tokens,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
        )
        self.recorder.add(record)
        return record

    def _commit(self, result: StepResult) -> None:
        """Commit the oldest in-flight plan's result. A result that does not fit it (unknown,
        duplicated or out-of-order step, ids it did not schedule, tokens outside the
        vocabulary, nonsense timings) drops the worker with the reason; nothing is committed."""
        if self._scheduler is None:
            return  # the worker was lost; its late results are meaningless
        start = time.time()
        try:
            if not self._in_flight:
                raise ValueError(f"result for step {result.step_id}, but no step is in flight")
            plan = self._in_flight[0]
            if plan.step_id != result.step_id:
                raise ValueError(f"result for step {result.step_id}, but step {plan.step_id} is the oldest in flight")
            _check_timing(result)
            events = self._scheduler.update_from_output(plan, result)
        except ValueError as exc:
            self._lose_worker(f"invalid step result: {exc}", WorkerRefused(WorkerRefused.Kind.INVALID, str(exc)))
            return
        self._in_flight.popleft()
        self._pump()  # the next plan leaves before clients are served: the device waits for it
        self.metrics.on_events(events)
        self._dispatch(events)
        record = self.recorder.get(plan.step_id)
        if record is not None:
            record.commit_start, record.result_committed, record.worker = start, time.time(), result.timing
            self.metrics.on_step(record, self._scheduler.stats())

    def _dispatch(self, events: list[RequestEvent]) -> None:
        """Hand events to their sinks: one list per sink, so a gateway session gets one message."""
        batches: dict[int, tuple[GatewaySession, list[RequestEvent]]] = {}
        for event in events:
            sink = self._streams.get(event.request_id)
            if sink is None:
                continue
            batches.setdefault(id(sink), (sink, []))[1].append(event)
            if event.finish_reason is not None:
                del self._streams[event.request_id]
        for sink, batch in batches.values():
            sink.put_many(batch)


def _check_timing(result: StepResult) -> None:
    """Worker timings feed metrics and the flight recorder: finite, non-negative seconds."""
    for name, value in dataclasses.asdict(result.timing).items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"result {result.step_id}: timing.{name} is {value!r}")
