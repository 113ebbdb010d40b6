"""The worker's side of the AttachWorker stream, and the loop that keeps it attached.

    reconnect(config, stop, log, session): dial → wait until the channel is ready →
    session(channel) → on any end, back off (doubling up to --reconnect-max-backoff-s,
    interrupted by SIGTERM) and dial again.

A single worker's session is `attach_once`; a tensor-parallel rank's joins a group first
(`parallel/session.py`). Both run inside the same `reconnect` loop.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import grpc

from stepahead import codec, daemon, jitter
from stepahead import config as cfg
from stepahead.logs import RateLimitedLog
from stepahead.plan import GrammarReady, KVLoaded, WorkerInfo
from worker_service.config import WorkerConfig
from worker_service.health import NoHealth, WorkerHealth
from worker_service.metrics import WorkerMetrics

FIRST_BACKOFF_S = 0.05


class HelloRefused(Exception):
    """The scheduler refused this worker's hello as invalid: the same worker would be refused
    again, so the daemon stops instead of re-attaching until start-up times out."""


class Pipeline:
    """Plans in → launched on the stream's reader thread; results out on grpc's request
    thread, in plan order.

    Each step is launched as soon as its plan arrives, on the thread that read it (a
    placeholder decode reads the previous step's ids on the device). `requests()` is the
    request stream's iterator: grpc's own thread runs it, waits there for each launched
    step's sampled ids to reach the host (the one sync per step) and sends the result at
    once. Neither way has a hand-off to another thread of ours: on a loaded host each one
    is a wake-up the device would wait for (the scheduler plans the step after next only
    once this result is in).

    The outbox carries the request stream in order: the hello, launched steps, a fatal
    error, None (the end). Any exception (a plan the worker cannot run, an asynchronous
    device error surfacing in `wait()`) ends the session the same way: a `fatal_error`
    message tells the scheduler why (it fails the requests the worker held), the request
    stream closes (the scheduler then ends the plan stream), `on_fatal` cancels the call
    should the scheduler not do so within `FATAL_GRACE_S`, and `error` is set for the caller.
    """

    FATAL_GRACE_S = 30.0  # generous: under load a scheduler may take seconds to read the reason

    def __init__(self, runner, hello, log, metrics: WorkerMetrics | None = None, report: bool = True) -> None:
        self.runner, self.log = runner, log
        # a request that fails alone (a grammar that does not compile: a client can send those at
        # will) is counted in `failed_requests` and logged at most once per 10 s
        self._request_failed = RateLimitedLog(log, "request_failed")
        self.on_fatal = lambda: None  # set once the call exists (it cancels it)
        self.report = report  # False on tensor-parallel ranks other than 0: they send no results
        self.metrics = metrics or WorkerMetrics()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # WorkerMessages and launched steps; None ends
        self.outbox.put(hello)
        self.error: BaseException | None = None
        self._failed = threading.Event()
        self._fatal_timer: threading.Timer | None = None

    def submit(self, plan_msg, received: float) -> None:
        """Launch the plan's step (on the caller's thread); after a failure, plans are dropped."""
        if self._failed.is_set():
            return
        try:
            jitter.maybe_jitter()  # test-only delay (STEPAHEAD_TEST_JITTER_MS); a no-op when unset
            plan = codec.plan_from_proto(plan_msg)
            self.metrics.on_plan(plan)
            self.outbox.put(self.runner.launch(plan, received))
        except Exception as exc:  # reported to the scheduler; the session ends
            self._fail(exc, "launch")

    def requests(self):
        """The request stream: each message as it comes; a launched step's result once its ids
        are on the host (nothing after a failure but the fatal error)."""
        from stepahead.v1 import scheduler_pb2

        while (item := self.outbox.get()) is not None:
            if type(item) is scheduler_pb2.WorkerMessage:
                yield item
            elif not self._failed.is_set():
                try:
                    message = self._result_message(item)
                except Exception as exc:  # e.g. an asynchronous device error: reported, never a silent hang
                    self._fail(exc, "wait")
                    continue
                if message is not None:
                    yield message

    def _result_message(self, pending):
        """Wait for a launched step; its result message (None on ranks that do not report)."""
        from stepahead.v1 import scheduler_pb2

        result = pending.wait()
        for rid, reason in result.failed.items():
            self._request_failed.note(request_id=rid, step_id=result.step_id, reason=reason)
        result = dataclasses.replace(result, timing=dataclasses.replace(result.timing, result_sent=time.time()))
        self.metrics.on_result(result)
        return scheduler_pb2.WorkerMessage(result=codec.result_to_proto(result)) if self.report else None

    def send_kv_loaded(self, loaded: KVLoaded) -> None:
        """A KV load's report, from a loader thread: on the stream in the order it is queued
        (a thread-safe queue), between results."""
        from stepahead.v1 import scheduler_pb2

        self.outbox.put(scheduler_pb2.WorkerMessage(kv_loaded=codec.kv_loaded_to_proto(loaded)))

    def send_grammar_ready(self, ready: GrammarReady) -> None:
        """A prepared grammar's report, from the compile thread: on the stream in the order it is
        queued, between results."""
        from stepahead.v1 import scheduler_pb2

        self.outbox.put(scheduler_pb2.WorkerMessage(grammar_ready=codec.grammar_ready_to_proto(ready)))

    def close(self) -> None:
        self.outbox.put(None)  # the request stream ends, whatever happened
        if self._fatal_timer is not None:
            self._fatal_timer.cancel()

    def _fail(self, exc: BaseException, where: str) -> None:
        """First failure wins: tell the scheduler, close the stream, stop the session."""
        if self._failed.is_set():
            return
        self._failed.set()
        self.error = exc
        self.log.error("step_failed", where=where, error=repr(exc)[:500], exc_info=exc)
        from stepahead.v1 import scheduler_pb2

        self.outbox.put(scheduler_pb2.WorkerMessage(fatal_error=f"{where}: {exc!r}"[:1000]))
        self.outbox.put(None)
        self._fatal_timer = threading.Timer(self.FATAL_GRACE_S, lambda: self.on_fatal())
        self._fatal_timer.daemon = True
        self._fatal_timer.start()


class StopWatch:
    """Ends the current attach session when the daemon is told to stop: one thread for the
    daemon's whole life, not one per attach (re-attaching must not leak threads).

    The worker detaches cleanly (it closes its request stream; the scheduler then closes
    the plan stream); the call is cancelled only if that has not happened in `GRACE_S`.
    """

    GRACE_S = 2.0

    def __init__(self, stop: threading.Event, on_stop=lambda: None) -> None:
        self._lock = threading.Lock()
        self._session = None
        self._stopped = False
        self._on_stop = on_stop
        threading.Thread(target=self._watch, args=(stop,), name="stop-watch", daemon=True).start()

    def _watch(self, stop: threading.Event) -> None:
        stop.wait()
        self._on_stop()  # draining: not ready any more
        with self._lock:
            self._stopped = True
            if self._session is not None:
                self._detach(*self._session)

    def _detach(self, call, outbox: queue.SimpleQueue) -> None:
        from stepahead.v1 import scheduler_pb2

        outbox.put(scheduler_pb2.WorkerMessage(detach="the worker is stopping"))  # a leave, not a loss
        outbox.put(None)
        timer = threading.Timer(self.GRACE_S, call.cancel)
        timer.daemon = True
        timer.start()

    def track(self, call, outbox: queue.SimpleQueue | None = None) -> None:
        with self._lock:
            self._session = (call, outbox) if call is not None else None
            if self._stopped and call is not None:
                self._detach(call, outbox)


def attach_once(channel, runner, info: WorkerInfo, watch: StopWatch, log,
                metrics: WorkerMetrics | None = None, health: WorkerHealth | NoHealth = NoHealth(),
                new_loader: Callable[[Callable[[KVLoaded], None]], object] | None = None) -> None:
    """One attach session: hello, then execute plans until the stream ends. Health is
    SERVING from the scheduler's acceptance (initial metadata) until the stream ends.

    `new_loader(report)`: the session's `kv_loads.KVLoader`, which sends each KV load's end
    on this stream (None: this worker loads no KV, e.g. a tensor-parallel rank); it is closed
    with the session (loads in flight are cancelled and their reports dropped)."""
    from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

    hello = scheduler_pb2.WorkerMessage(hello=codec.worker_info_to_proto(info))
    pipeline = Pipeline(runner, hello, log, metrics=metrics, report=info.tp_rank == 0)
    loader = runner.kv_loader = new_loader(pipeline.send_kv_loaded) if new_loader is not None else None
    if info.prepares_grammars and info.tp_rank == 0:
        runner.grammar_report = pipeline.send_grammar_ready
    try:
        _run_session(channel, pipeline, info, watch, log, health)
    finally:
        runner.kv_loader = None
        if info.prepares_grammars:
            runner.grammar_report = None  # (a compile this session ordered reports into its closed outbox)
        if loader is not None:
            loader.close()


def _run_session(channel, pipeline: Pipeline, info: WorkerInfo, watch: StopWatch, log,
                 health: WorkerHealth | NoHealth) -> None:
    from stepahead.v1 import scheduler_pb2_grpc

    responses = scheduler_pb2_grpc.SchedulerStub(channel).AttachWorker(pipeline.requests())
    pipeline.on_fatal = responses.cancel
    watch.track(responses, pipeline.outbox)
    log.info("attached", worker_id=info.worker_id)
    try:
        if daemon.ATTACH_ACCEPTED in (responses.initial_metadata() or ()):  # blocks until accepted or refused
            health.attached()
        for msg in responses:
            pipeline.submit(msg.plan, time.time())
    except Exception:
        if pipeline.error is None:
            raise  # the stream broke (scheduler gone or refused us): the caller logs it
    finally:
        health.detached()
        watch.track(None)
        pipeline.close()
        responses.cancel()
    if pipeline.error is not None:
        raise pipeline.error


def reconnect(config: WorkerConfig, stop: threading.Event, log, session: Callable[[grpc.Channel], bool],
              *, on_session_end: Callable[[], None] = lambda: None, failed_event: str = "attach_session_failed",
              refusal_is_final: bool = True) -> None:
    """Run `session(channel)` against the scheduler until `stop` is set or a session returns
    False. A broken or refused connection is retried with backoff (logged at warning once a
    scheduler has been gone for several attempts: restarting is normal, gone for long is
    not); any other exception ends that session (`failed_event`), and the loop starts
    clean. `on_session_end` runs after every session. With `refusal_is_final`, a hello the
    scheduler refuses as invalid raises `HelloRefused` (the same worker would be refused again)."""
    backoff, failures = FIRST_BACKOFF_S, 0
    while not stop.is_set():
        with config.scheduler_channel(config.scheduler) as channel:
            try:
                daemon.wait_channel_ready(channel, max(backoff, 1.0))
                backoff = FIRST_BACKOFF_S
                if not session(channel):
                    break
                failures = 0
            except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                if refusal_is_final and isinstance(exc, grpc.RpcError) and \
                        exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise HelloRefused(f"the scheduler at {config.scheduler} refused this worker: "
                                       f"{exc.details()}") from exc
                failures += 1
                if not stop.is_set():
                    (log.warning if failures > 5 else log.info)(
                        "attach_failed", scheduler=config.scheduler, attempts=failures, error=repr(exc)[:300])
            except cfg.ConfigError:
                raise  # a setting the next session would meet again (a KV budget that holds no block)
            except Exception as exc:  # a failed step (already reported to the scheduler) or collective
                log.warning(failed_event, error=repr(exc)[:300])
            finally:
                on_session_end()
        stop.wait(backoff)
        backoff = min(backoff * 2, config.reconnect_max_backoff_s)
