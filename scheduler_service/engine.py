"""The scheduler daemon's engine: routes requests to data-parallel replicas and drives them.

Pure domain code (no grpc): the servicer hands it submissions, aborts, workers' hellos and
step results; it hands plans to each worker's outbox and events to gateway sessions. The
engine is one coroutine on an asyncio event loop (the daemon's, which owns every gRPC stream
too; or a loop of its own on a thread, `start()` with no loop). It owns every replica
(`replica.py`: a scheduler core + a `StepLoop` each) and takes what the streams hand it
through its inbox (`inbox.py`); other threads call in through `loop.call_soon_threadsafe`
(`_call`, `submit`, `abort`, ...), so nothing needs a lock.

Every worker that attaches becomes a replica and takes requests at once. A new request is
placed on one replica by the router (`router.py`) and stays there: each replica has its
own waiting queue (see docs/architecture.md for why). A replica whose stream breaks, whose
result does not fit its plan, or that misses `worker_step_timeout_s` is dropped; its
unfinished requests move to the other replicas as recompute (prompt + committed output,
`Scheduler.adopt`), so their clients' streams continue with no gap and no duplicate. With
no replica left they wait up to `worker_wait_timeout_s`, then end UNAVAILABLE.

Disaggregation (docs/disaggregation.md): new prompts go to replicas whose worker's role
prefills (`prefill` or `both`; any replica when none does). A `prefill` replica's core hands
each request off after its first token; the engine gives it to a replica that decodes
(`decode` or `both`, by the router among them) with the source worker's address and blocks,
and frees the source blocks once the decode core is done with them (`transfers.py`). With
no replica that decodes, a handed-off request waits like one with no replica at all.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.core.admission import check_submission
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.groups import GroupAssembly, GroupFormer
from scheduler_service.inbox import Abort, Attach, Call, CloseSession, Inbox, Stop, Submit
from scheduler_service.links import (
    GatewaySession, NoWorker, PlanOutbox, RejectCode, Rejected, WorkerGrammarReady, WorkerHandle, WorkerKVLoaded,
    WorkerLost, WorkerRefused, WorkerResult, rejection,
)
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.replica import Replica
from scheduler_service.core.events import PlainTokens, StepEvents, split_plain
from scheduler_service.core.request import Request
from scheduler_service.router import Candidate, Router, RouterConfig
from scheduler_service.core.scheduler import FinishReason, RequestEvent, RequestRejected, Scheduler
from scheduler_service.core.stats import SchedulerStats, sum_stats
from scheduler_service.transfers import Transfers
from stepahead.logs import RateLimitedLog
from stepahead import jitter
from stepahead.flight_recorder import StepRecord
from stepahead.heap import collections_paused, freeze_heap
from stepahead.plan import WorkerInfo, WorkerRole

__all__ = ["Engine", "EngineOptions", "GatewaySession", "NoWorker", "PlanOutbox", "RejectCode", "Rejected",
           "WorkerHandle", "WorkerRefused"]


@dataclass(frozen=True)
class EngineOptions:
    routing: RouterConfig = RouterConfig()
    worker_step_timeout_s: float = 300.0  # a step in flight longer than this drops its replica
    worker_wait_timeout_s: float = 60.0  # requests without any replica end UNAVAILABLE after this
    recorder_steps: int = 1000  # flight-recorder steps kept per replica
    group_attach_timeout_s: float = 60.0  # a tensor-parallel group whose ranks do not all attach is closed
    freeze_heap_on_attach: bool = False  # the daemon's: gc.freeze() a new replica's block pool (heap.freeze_heap)


# Geometry every replica of one scheduler must share (requests move between them).
_SAME_ON_EVERY_REPLICA = ("model_name", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "max_logprobs")


class Engine:
    def __init__(self, make_config: Callable[[WorkerInfo], SchedulerConfig], log,
                 on_ready_change: Callable[[bool], None] = lambda ready: None, options: EngineOptions = EngineOptions(),
                 on_fatal: Callable[[], None] = lambda: None, metrics: SchedulerMetrics | None = None) -> None:
        self.metrics = metrics or SchedulerMetrics()
        self.options = options
        self._on_fatal = on_fatal
        self.crashed = False
        self._make_config = make_config
        self._log = log
        self._stalls = RateLimitedLog(log, "scheduler_stalled")  # a core whose steps give nobody a token
        self._on_ready_change = on_ready_change
        self._inbox = Inbox()
        self._replicas: dict[WorkerHandle, Replica] = {}
        self._model: WorkerInfo | None = None  # the first replica's hello: what this scheduler serves
        self._router: Router | None = None  # new prompts
        self._decode_router: Router | None = None  # handed-off requests, among the replicas that decode
        self._transfers = Transfers()
        self._owner: dict[str, Replica] = {}  # request id -> the replica holding it
        self._parked: dict[str, tuple[Request, float]] = {}  # no replica: request, monotonic deadline
        self._streams: dict[str, GatewaySession] = {}  # request id -> the session it came on
        self._holding: set[GatewaySession] = set()  # sessions holding plain tokens (SessionOptions)
        self._carried_counts: collections.Counter = collections.Counter()  # monotonic counters of lost replicas
        self._earlier_counts: dict[str, collections.Counter] = {}  # ... by replica name (for /metrics)
        self.groups = GroupFormer()  # JoinGroup callers (servicer threads) -> tensor-parallel groups
        self._assembly = GroupAssembly(self.groups.formed, options.group_attach_timeout_s)  # one replica per group
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None  # the loop's, when the engine runs its own
        self._task: asyncio.Task | None = None
        self.metrics.watch_replicas(self._metrics_snapshot)

    # ---- thread-safe entry points -------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Run the engine on `loop` (call this on that loop's thread, e.g. the daemon's), or
        with no loop on a fresh one in a thread of its own."""
        if loop is not None:
            self._begin(loop)
            return
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="engine", daemon=True)
        self._thread.start()
        started = concurrent.futures.Future()
        loop.call_soon_threadsafe(lambda: started.set_result(self._begin(loop)))
        started.result(30)

    def _begin(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._inbox.bind(loop)
        self._task = loop.create_task(self._run(), name="engine")

    def stop(self) -> None:
        """End the engine (from another thread: returns once it ended, within 5 s; on the
        loop: returns at once, `stopped()` awaits the end)."""
        self._inbox.put(Stop())
        if self._thread is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.stopped(), self._loop).result(5)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        elif self._task is not None and not self._inbox.on_loop():
            try:
                asyncio.run_coroutine_threadsafe(self.stopped(), self._loop).result(5)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass

    async def stopped(self) -> None:
        """Wait until the engine's coroutine ended (stopped or crashed)."""
        if self._task is not None:
            await asyncio.wait([self._task])

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def worker(self) -> WorkerInfo | None:
        """The model this scheduler serves (the first replica's hello); None before any."""
        return self._model

    def submit(self, request: Request, session: GatewaySession) -> None:
        """Queue a request whose events go to `session`, in order with this thread's aborts (no
        round trip; blocks only while the session has its most queued, `reserve`). A refused
        request gets one `Rejected` event on `session` (QUEUE_FULL, INVALID or UNAVAILABLE).
        On the engine's loop it never blocks: a reader there awaits `submit_async`."""
        if self._inbox.on_loop():
            if not session.reserve(blocking=False):
                raise RuntimeError("the session has no room: on the engine's loop, await submit_async")
        else:
            session.reserve()
        self._inbox.put(Submit(request, session))

    async def submit_async(self, request: Request, session: GatewaySession) -> None:
        """`submit` for a reader on the engine's loop: awaits room in the session."""
        await session.reserve_async()
        self._inbox.put(Submit(request, session))

    def close_session(self, session: GatewaySession) -> None:
        """The gateway's stream ended: abort every request it still has, then close."""
        self._inbox.put(CloseSession(session))

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def attach_worker(self, info: WorkerInfo, outbox: PlanOutbox) -> WorkerHandle:
        handle = WorkerHandle(self._inbox.put, info, outbox)
        self._inbox.put(Attach(handle))
        return handle

    @property
    def carried_counts(self) -> collections.Counter:
        """Monotonic counters of the replicas lost so far (added to the live ones' totals)."""
        return self._carried_counts

    def stats(self) -> tuple[SchedulerStats | None, dict[str, SchedulerStats]]:
        """(every replica's stats summed, counters including lost replicas'; None while none
        is attached) and each attached replica's own stats by worker id, in attach order:
        one snapshot, taken between steps."""
        def snapshot():
            per = {r.name: r.scheduler.stats() for r in self._replicas.values()}
            return sum_stats(list(per.values()), self._carried_counts), per

        return self._call(snapshot)

    def _metrics_snapshot(self):
        """Every replica's stats and the earlier cores' counters by name, for a /metrics scrape
        (nothing when the engine does not answer within 5 s: a scrape never hangs)."""
        if self.crashed or not self.alive:
            return {}, {}
        try:
            return self._call(lambda: ({r.name: r.scheduler.stats() for r in self._replicas.values()},
                                       {k: collections.Counter(v) for k, v in self._earlier_counts.items()}), 5.0)
        except queue.Empty:
            return {}, {}

    def flight_records(self) -> list[tuple[str, list[StepRecord]]]:
        """(worker id, its recent steps) per attached replica: one trace lane each."""
        return self._call(lambda: [(r.name, r.recorder.snapshot()) for r in self._replicas.values()])

    def _call(self, fn: Callable[[], object], timeout: float | None = None) -> object:
        """Run fn on the engine's loop, between rounds, and return its result (or raise its
        exception); queue.Empty when `timeout` passes first. On the loop itself (the
        servicer's calls) fn runs at once: nothing else runs there meanwhile."""
        if self._inbox.on_loop():
            return fn()
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Call(fn, reply))
        try:
            return reply.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise queue.Empty from None

    # ---- engine loop ---------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._rounds()
        except asyncio.CancelledError:
            raise
        except BaseException:
            self.crashed = True
            self._log.exception("engine_crashed")
            self._on_fatal()
            raise

    async def _rounds(self) -> None:
        next_round, sleep = self._inbox.next_round, asyncio.sleep
        while True:
            for item in await next_round(self._next_deadline()):  # what came before planning
                if type(item) is WorkerResult:  # the hot path: commit, plan the next step, ...
                    replica = self._replicas.get(self._assembly.owner(item.handle))
                    if replica is None:  # late results of a dropped replica mean nothing
                        continue
                    events = self._commit(replica, item.result)
                    if events is not None:
                        await sleep(0)  # ... let the worker's writer send that plan, then serve clients
                        if self._replicas.get(replica.handle) is replica:
                            self._after_commit(replica, events)
                    continue
                if type(item) is Stop:
                    return
                self._handle(item)
            self._enforce_deadlines()
            jitter.maybe_jitter()  # test-only delay (STEPAHEAD_TEST_JITTER_MS); a no-op when unset
            for replica in list(self._replicas.values()):
                replica.pump()
                self._dispatch_shed(replica)
                self._release_sources(replica)
            if self._holding and not any(r.loop.num_in_flight for r in self._replicas.values()):
                self._flush_held()  # no step in flight: no later step would send them

    def _handle(self, item) -> None:
        match item:
            case Submit(request, session):
                self._guarded(request.request_id, session, self._submit, request, session)
            case Abort(request_id):
                self._guarded(request_id, self._streams.get(request_id), self._abort, request_id)
            case WorkerResult(handle, result):
                replica = self._replicas.get(self._assembly.owner(handle))
                if replica is not None:  # late results of a dropped replica mean nothing
                    events = self._commit(replica, result)
                    if events is not None:
                        self._after_commit(replica, events)
            case WorkerKVLoaded(handle, loaded):
                replica = self._replicas.get(self._assembly.owner(handle))
                if replica is not None:
                    self._kv_loaded(replica, loaded)
            case WorkerGrammarReady(handle, ready):
                replica = self._replicas.get(self._assembly.owner(handle))
                if replica is not None:
                    event = replica.scheduler.grammar_ready(ready)
                    if event is not None:  # refused: the request ends
                        self.metrics.on_events([event])
                        self._dispatch([event])
            case Attach(handle):
                if handle.info.tp_size > 1:  # a rank: the group attaches once all its ranks have
                    handle = self._assembly.add(handle)
                if handle is not None:
                    self._attach(handle)
            case WorkerLost(handle, reason, error, clean):
                replica = self._replicas.get(self._assembly.owner(handle))
                if replica is not None:  # a rank's loss is its group's
                    self._lose(replica, reason, error, clean)
                else:
                    self._assembly.rank_lost(handle)
            case CloseSession(session):
                for request_id in [rid for rid, sink in self._streams.items() if sink is session]:
                    self._abort(request_id)
                session.flush()
                self._holding.discard(session)
                session.close()
            case Call(fn, reply):
                try:
                    reply.set_result(fn())
                except Exception as exc:  # handed to the caller, never swallowed
                    reply.set_exception(exc)
            case _:
                raise AssertionError(f"unknown inbox item {item!r}")

    def _guarded(self, request_id: str, session: GatewaySession | None, handle: Callable, *args) -> None:
        """Handle one request's inbox item; should it raise (a bug, never a bad request: those
        are refused by name), that request alone fails and the engine goes on. The error is
        logged with its traceback and the request leaves the engine's maps, so its stream gets
        one UNAVAILABLE answer and no later event."""
        try:
            handle(*args)
        except Exception:
            self._log.exception("request_item_failed", request_id=request_id)
            self._drop(request_id)
            if session is not None:
                session.put_many([Rejected(request_id, "internal error in the scheduler while handling "
                                                       "this request", RejectCode.UNAVAILABLE)])

    def _drop(self, request_id: str) -> None:
        """Forget a request whose item failed, wherever the failure left it (best effort: a
        core that raised half way may still list it; its abort finishes it there)."""
        replica = self._owner.pop(request_id, None)
        self._parked.pop(request_id, None)
        self._streams.pop(request_id, None)
        self.metrics.forget(request_id)
        if replica is None:
            return
        try:
            replica.scheduler.abort(request_id)
        except Exception:  # the core is as the failure left it: said, and the engine goes on
            self._log.exception("request_drop_failed", request_id=request_id)

    # ---- requests ------------------------------------------------------------------
    def _submit(self, request: Request, session: GatewaySession) -> None:
        """Add a request; whatever is wrong with it is answered to it alone, on its session."""
        session.handled()
        try:
            self._add(request, session)
        except (RequestRejected, NoWorker) as exc:  # QueueFull is a RequestRejected
            session.put_many([rejection(request.request_id, exc)])

    def _add(self, request: Request, stream: GatewaySession) -> None:
        """Runs on the engine loop; raises RequestRejected (QueueFull) or NoWorker."""
        if self._model is None:
            raise NoWorker("no worker attached yet")
        if request.arrival_time is None:  # every policy key reads it, parked or placed
            request.arrival_time = time.monotonic()  # the daemon cores' clock
        if request.request_id in self._streams:
            raise RequestRejected("request_id: a request with this id is already in flight on this stream")
        if self._replicas:
            replica = self._place(request)
            replica.scheduler.add_request(request)
            self._owner[request.request_id] = replica
        else:  # replicas were lost: check it as a replica would, then wait for one
            check_submission(self._make_config(self._model), request, len(self._parked))
            self._park(request)
        self._streams[request.request_id] = stream
        self.metrics.on_submit(request.request_id)

    def _place(self, request: Request) -> Replica:
        """The replica for a new (or recomputed) request: among those that prefill."""
        candidates = _candidates(self._replicas, WorkerRole.DECODE)
        return self._replicas[self._router.choose(request, candidates)]

    def _decoder_for(self, request: Request) -> Replica | None:
        """The replica a handed-off request moves to: among those that decode; None if none."""
        candidates = _candidates(self._replicas, WorkerRole.PREFILL, fallback=False)
        return self._replicas[self._decode_router.choose(request, candidates)] if candidates else None

    def _park(self, request: Request) -> None:
        self._parked[request.request_id] = (request, time.monotonic() + self.options.worker_wait_timeout_s)

    def _abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            event = replica.scheduler.abort(request_id)
            self._release_sources(replica)
            if event is not None:
                self.metrics.on_events([event])
                self._dispatch([event])
        elif request_id in self._parked:
            request, _ = self._parked.pop(request_id)
            self.metrics.forget(request_id)
            self._dispatch([RequestEvent(request_id, (), FinishReason.ABORT, request.num_prompt_tokens, 0)])

    def _commit(self, replica: Replica, result) -> StepEvents | None:
        """Commit a result and plan the replica's next step (sent to its outbox); the step's
        events for `_after_commit`. A result that does not fit the oldest plan drops that
        replica (its requests move): None."""
        try:
            return replica.commit(result, self.metrics)
        except ValueError as exc:
            reason = f"invalid step result: {exc}"
            self._lose(replica, reason, WorkerRefused(WorkerRefused.Kind.INVALID, reason))
            return None

    def _after_commit(self, replica: Replica, events: StepEvents) -> None:
        """A committed step's events to their clients and metrics, hand-offs moved."""
        self.metrics.on_step_events(events)
        self._dispatch(events.events, events.plain)
        if replica.handle.info.role is WorkerRole.PREFILL:
            self._move_handoffs(replica)
        stalled = replica.scheduler.stall()
        if stalled is not None:
            self._stalls.note(replica=replica.name, reason=stalled)

    def _move_handoffs(self, source: Replica) -> None:
        """Give each request the prefill replica handed off to a replica that decodes, with
        where its KV is; with none, it waits as a request with no replica (recomputed)."""
        for handoff in source.scheduler.take_handoffs():
            request = handoff.request
            rid = request.request_id
            if rid not in self._streams:  # ended meanwhile (nothing can: defensive)
                source.scheduler.release_handoff(rid)
                continue
            target = self._decoder_for(request)
            if target is None:
                source.scheduler.release_handoff(rid)
                self._owner.pop(rid, None)
                self._park(request)
                continue
            transfer_id = self._transfers.start(source.handle, rid)
            info = source.handle.info
            target.scheduler.add_transferred(request, info.kv_transfer_address, handoff.block_ids, transfer_id,
                                             info.kv_transfer_instance)
            self._owner[rid] = target

    def _kv_loaded(self, replica: Replica, loaded) -> None:
        """A decode worker's load ended; one it was never ordered drops the replica."""
        try:
            replica.scheduler.kv_loaded(loaded)
        except ValueError as exc:
            reason = f"invalid kv_loaded: {exc}"
            self._lose(replica, reason, WorkerRefused(WorkerRefused.Kind.INVALID, reason))
            return
        if loaded.error:
            self._log.warning("kv_load_failed", worker_id=replica.name, transfer_id=loaded.transfer_id,
                              error=loaded.error[:300])
        self._release_sources(replica)

    def _release_sources(self, replica: Replica) -> None:
        """Free, on their prefill replicas, the source blocks `replica`'s core is done with."""
        released = replica.scheduler.take_released_sources()
        for source_handle, rid in self._transfers.end(released) if released else ():
            source = self._replicas.get(source_handle)
            if source is not None:
                source.scheduler.release_handoff(rid)

    def _dispatch_shed(self, replica: Replica) -> None:
        """Requests the replica's core refused after queueing them (admission control: not
        admitted within --max-wait-time) are answered like a refused submission: QUEUE_FULL."""
        shed = replica.scheduler.take_shed()
        for request_id, _ in shed:
            self.metrics.forget(request_id)
        if shed:
            self._dispatch([Rejected(rid, str(refusal), RejectCode.QUEUE_FULL) for rid, refusal in shed])

    def _dispatch(self, events: list[RequestEvent | Rejected], plain: PlainTokens | None = None) -> None:
        """Hand events to their sinks: one list per sink, so a gateway session gets one message
        (a step's plain tokens go as one `PlainTokens` per session, after its events)."""
        streams, batches = self._streams, {}  # session (hashed by identity) -> its events
        for event in events:
            sink = streams.get(event.request_id)
            if sink is None:
                continue
            batches.setdefault(sink, []).append(event)
            if isinstance(event, Rejected) or event.finish_reason is not None:
                del streams[event.request_id]
                self._owner.pop(event.request_id, None)
        held = {}  # sink -> this step's plain parts, for a session that may hold them
        for sink, part in split_plain(plain, streams.get) if plain else ():
            if sink.plain_token_steps > 1 and sink not in batches:
                held.setdefault(sink, []).append(part)
            else:
                batches.setdefault(sink, []).append(part)
        for sink, batch in batches.items():
            sink.put_many(batch)  # any plain tokens it held go first
            self._holding.discard(sink)
        for sink, parts in held.items():
            if sink.hold_plain(parts):
                self._holding.add(sink)
            else:
                self._holding.discard(sink)

    def _flush_held(self) -> None:
        for session in self._holding:
            session.flush()
        self._holding.clear()

    # ---- replicas ------------------------------------------------------------------
    def _attach(self, handle: WorkerHandle) -> None:
        """Every worker that attaches becomes a replica, if it serves the same model."""
        info = handle.info
        if self._model is not None:
            diff = [k for k in _SAME_ON_EVERY_REPLICA if getattr(info, k) != getattr(self._model, k)]
            if diff:
                handle.outbox.close(WorkerRefused(WorkerRefused.Kind.MISMATCH, "hello differs from the other "
                                    f"replicas in {', '.join(diff)}: one scheduler serves one model"))
                return
        freeze = self.options.freeze_heap_on_attach
        try:
            with collections_paused() if freeze else contextlib.nullcontext():
                scheduler = Scheduler(self._make_config(info))
        except ValueError as exc:  # the hello's geometry does not fit the scheduler's flags
            handle.outbox.close(WorkerRefused(WorkerRefused.Kind.INVALID, f"hello: {exc}"))
            return
        if freeze:
            freeze_heap()  # its block pool (an object per KV block) lives as long as the replica
        if self._model is None:
            self._model = info
            self._router = Router(self.options.routing, info.block_size)
            self._decode_router = Router(self.options.routing, info.block_size)
        self._replicas[handle] = Replica(handle, scheduler, self.options.recorder_steps)
        handle.outbox.accept()
        self._log.info("worker_attached", replicas=len(self._replicas), **dataclasses.asdict(info))
        self.metrics.on_replica_attached(len(self._replicas))
        parked, self._parked = self._parked, {}
        for request, _ in parked.values():
            self._adopt(request)
        if len(self._replicas) == 1:
            self._on_ready_change(True)

    def _lose(self, replica: Replica, reason: str, error: WorkerRefused | None = None, clean: bool = False) -> None:
        """Drop the replica and close its stream; its unfinished requests move (recompute).
        `clean`: the worker closed its stream itself (leaving, e.g. SIGTERM): info, not a loss."""
        moving = replica.scheduler.release()
        del self._replicas[replica.handle]
        self._release_sources(replica)  # the moves into it end: their requests move on as recompute
        for transfer_id, rid in self._transfers.from_source(replica.handle):  # the moves out of it lose their KV
            target = self._owner.get(rid)
            if target is not None:
                target.scheduler.source_lost(transfer_id)
                self._release_sources(target)
        self._assembly.forget(replica.handle)
        self._router.forget(replica.handle)
        self._decode_router.forget(replica.handle)
        counts = replica.scheduler.counters()
        self._carried_counts += counts  # totals go on without it
        self._earlier_counts[replica.name] = self._earlier_counts.get(replica.name, collections.Counter()) + counts
        log = self._log.info if clean and not moving else self._log.warning
        log("worker_detached" if clean else "worker_lost", worker_id=replica.name, reason=reason,
            requests_moved=len(moving), replicas=len(self._replicas))
        if not self._replicas:
            self._on_ready_change(False)
        replica.handle.outbox.close(error)
        self.metrics.on_replica_lost(replica.name, len(moving), len(self._replicas), lost=not clean)
        for request in moving:
            self._adopt(request)

    def _adopt(self, request: Request) -> None:
        if not self._replicas:
            self._owner.pop(request.request_id, None)
            self._park(request)
            return
        replica = (request.num_output_tokens and self._decoder_for(request)) or self._place(request)
        replica.scheduler.adopt(request)
        self._owner[request.request_id] = replica

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        self._assembly.expire(now)
        timeout = self.options.worker_step_timeout_s
        for replica in list(self._replicas.values()):
            deadline = replica.step_deadline(timeout)
            if deadline is not None and deadline <= now:
                self._lose(replica, f"no step result for {timeout:g} s (--worker-step-timeout)")
        if not self._parked:
            return
        expired = [rid for rid, (_, deadline) in self._parked.items() if deadline <= now]
        for rid in expired:
            del self._parked[rid]
            self.metrics.forget(rid)
        if expired:
            self._dispatch([Rejected(rid, f"no worker attached for {self.options.worker_wait_timeout_s:g} s "
                                          "(--worker-wait-timeout)", RejectCode.UNAVAILABLE) for rid in expired])

    def _next_deadline(self) -> float | None:
        """The earliest deadline (monotonic clock: the loop's), None when there is none."""
        timeout = self.options.worker_step_timeout_s
        deadlines = [d for r in self._replicas.values() if (d := r.step_deadline(timeout)) is not None]
        if self._parked:
            deadlines += [d for _, d in self._parked.values()]
        if (d := self._assembly.next_deadline()) is not None:
            deadlines.append(d)
        return min(deadlines) if deadlines else None


def _candidates(replicas: dict[WorkerHandle, Replica], avoid: WorkerRole, fallback: bool = True) -> list[Candidate]:
    """The replicas whose role is not `avoid`; all of them when there are none and `fallback`."""
    chosen = [Candidate(h, r.load) for h, r in replicas.items() if h.info.role is not avoid]
    return chosen if chosen or not fallback else [Candidate(h, r.load) for h, r in replicas.items()]
