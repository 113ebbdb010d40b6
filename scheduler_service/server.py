"""The scheduler daemon: a thin gRPC servicer around the engine.

    stepahead scheduler --port 50051 [--max-num-seqs ...]

Gateways open one Connect stream each (plus GetStats/GetModel); workers open AttachWorker. Protos become domain
objects here and nowhere else in scheduler_service. One asyncio event loop runs the grpc.aio
server, every stream's reader and writer, and the engine (no thread per stream, no engine
thread: a step's result, commit, next plan and events never cross a thread).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
from dataclasses import dataclass, replace

import grpc
from prometheus_client import REGISTRY, start_http_server

from scheduler_service.core.config import SchedulerConfig, SchedulingConfig
from scheduler_service.engine import Engine, EngineOptions
from scheduler_service.event_batches import event_batches
from scheduler_service.groups import Joiner
from scheduler_service.links import (
    GatewaySession,
    LoopOutbox,
    NoWorker,
    WorkerHandle,
    WorkerRefused,
    rejection,
)
from scheduler_service.router import RouterConfig, RoutingPolicy
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import RequestRejected
from stepahead.knobs import SpeculativeFlag, fields_of
from stepahead.speculative import num_speculative_tokens
from stepahead.heap import GcPauses, freeze_heap, gc_warning_threshold_field
from stepahead.undecodable import AioUndecodableGuard, Undecodable, reads_undecodable
from stepahead import codec, daemon, limits, logs, ports, security
from stepahead import config as cfg
from stepahead.plan import WorkerInfo, WorkerRole
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


@dataclass(frozen=True)
class SchedulerListenConfig:
    """How the scheduler process listens: its own, never handed on by `stepahead serve`."""

    host: str = cfg.field("127.0.0.1", "address to listen on")
    port: int = cfg.field(50051, "port to listen on (0 picks a free one)")
    cluster_token: str | None = cfg.field(None, "shared secret every internal call must carry (required off "
                                                "loopback unless --insecure)")
    insecure: bool = cfg.field(False, "allow listening off loopback without a cluster token")
    ssl_certfile: str | None = cfg.field(None, "TLS certificate (PEM) of the internal plane")
    ssl_keyfile: str | None = cfg.field(None, "TLS private key (PEM) of the internal plane")
    ssl_ca_certs: str | None = cfg.field(None, "CA bundle: require client certificates signed by it (mTLS)")
    enable_reflection: bool = cfg.field(False, "serve gRPC reflection of the internal services")
    log_level: str = cfg.field("info", "log level")


@dataclass(frozen=True)
class SchedulerEngineConfig:
    """The engine around the core: routing across replicas, timeouts, observability."""

    routing_policy: RoutingPolicy = cfg.field(RoutingPolicy.CACHE_AWARE, "which replica takes a new request")
    balance_abs_threshold: int = cfg.field(
        32, "cache_aware: route by load instead of prefix when max - min replica load exceeds this ...")
    balance_rel_threshold: float = cfg.field(1.5, "... and max load exceeds min load times this")
    worker_step_timeout: float = cfg.field(
        300.0, "seconds a replica may take for its oldest step in flight before it is dropped (its requests move)")
    worker_wait_timeout: float = cfg.field(
        60.0, "seconds requests wait for a replica when none is attached, then end UNAVAILABLE")
    flight_recorder_steps: int = cfg.field(1000, "steps kept by the flight recorder, per replica")
    metrics_port: int | None = cfg.field(None, "serve Prometheus /metrics on this port (off when unset)")
    gc_warning_threshold_secs: float = gc_warning_threshold_field()


@dataclass(frozen=True)
class SchedulerDaemonConfig(SchedulerEngineConfig, SpeculativeFlag, SchedulingConfig, SchedulerListenConfig):
    """`stepahead scheduler`'s flags: how it listens, the scheduling knobs (the core's own
    group), speculation and the engine."""

    def engine_options(self) -> EngineOptions:
        for name in ("worker_step_timeout", "worker_wait_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        routing = RouterConfig(RoutingPolicy(self.routing_policy), self.balance_abs_threshold,
                               self.balance_rel_threshold)
        return EngineOptions(routing, self.worker_step_timeout, self.worker_wait_timeout, self.flight_recorder_steps)

    def check_exposure(self) -> None:
        """No open internal plane off loopback: a token, or an explicit --insecure."""
        if not self.cluster_token and not self.insecure and not security.is_loopback(self.host):
            raise cfg.ConfigError(f"refusing to listen on {self.host} without --cluster-token (or "
                                  "STEPAHEAD_CLUSTER_TOKEN); pass --insecure to allow it")

    def core_config(self, info: WorkerInfo) -> SchedulerConfig:
        """The core's config: this daemon's scheduling knobs and the replica's geometry."""
        knobs = {name: getattr(self, name) for name in fields_of(SchedulingConfig)}
        return SchedulerConfig(
            **knobs,
            block_size=info.block_size,
            num_gpu_blocks=info.num_device_blocks,
            num_cpu_blocks=info.num_host_blocks,
            max_model_len=info.max_model_len,
            num_speculative_tokens=num_speculative_tokens(self.speculative_config),
            eos_token_ids=info.eos_token_ids,
            vocab_size=info.vocab_size,
            max_logprobs=info.max_logprobs,
            # a prefill replica hands its requests' whole KV off: it frees nothing early
            sliding_window=0 if info.role is WorkerRole.PREFILL else info.sliding_window,
            num_offload_blocks=min(info.num_offload_blocks, info.num_host_blocks),
            role=info.role,
            prepare_grammars=info.prepares_grammars and info.structured_outputs,
        )


def request_from_proto(msg: scheduler_pb2.SubmitRequest, info: WorkerInfo, scope: str = "") -> Request:
    """The domain request; its id is the gateway's id inside the session's `scope`, so a
    gateway can neither collide with, probe nor abort another gateway's requests."""
    if not msg.prompt_token_ids:
        raise RequestRejected("prompt_token_ids is empty")
    if not msg.request_id:
        raise RequestRejected("request_id is empty")
    try:
        limits.check_id("request_id", msg.request_id)
    except limits.LimitError as exc:
        raise RequestRejected(str(exc)) from None
    sampling = codec.sampling_from_proto(
        msg.sampling, default_max_tokens=max(info.max_model_len - len(msg.prompt_token_ids), 1)
    )
    return Request(
        scope + msg.request_id,
        list(msg.prompt_token_ids),
        sampling,
        priority=msg.priority,
        cache_salt=msg.cache_salt or None,
    )


REFUSAL_STATUS = {
    WorkerRefused.Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    WorkerRefused.Kind.MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
}


def stats_to_proto(stats) -> scheduler_pb2.SchedulerStats:
    fields = scheduler_pb2.SchedulerStats.DESCRIPTOR.fields_by_name
    return scheduler_pb2.SchedulerStats(worker_attached=True, **{k: v for k, v in vars(stats).items() if k in fields})


class _GatewayStreamEnd:
    """How `SchedulerServicer.end_streams` ends one Connect stream: its writer, and the wait
    for the gateway's first message (a gateway says nothing until its first request)."""

    def __init__(self, session: GatewaySession) -> None:
        self.session = session
        self._ended = asyncio.Event()

    def close(self) -> None:
        self.session.close()
        self._ended.set()

    def wait(self) -> asyncio.Future:
        return asyncio.ensure_future(self._ended.wait())


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Async methods on the daemon's one event loop, which runs the engine too: a stream's
    reader hands the engine what it reads (the engine's inbox, on the same loop) and its
    writer awaits what the engine hands it (`LoopOutbox`, `GatewaySession.batches`)."""

    def __init__(self, engine: Engine, log, guard: AioUndecodableGuard | None = None) -> None:
        self.engine = engine
        self.log = log
        self.guard = guard  # the server's: the stream readers hand it what does not decode
        self._sessions = itertools.count(1)
        self._open: set = set()  # how to end each open stream (_GatewayStreamEnd, LoopOutbox): `end_streams`
        self._none_open: asyncio.Event | None = None  # set while `_open` is empty (made on the loop)

    def _track(self, writer, context) -> None:
        """`writer` is its stream's until the call ends (whichever way)."""
        self._open.add(writer)
        if self._none_open is not None:
            self._none_open.clear()
        context.add_done_callback(lambda _: self._untrack(writer))

    def _untrack(self, writer) -> None:
        self._open.discard(writer)
        if not self._open and self._none_open is not None:
            self._none_open.set()

    async def wait_streams(self, grace_s: float) -> None:
        """At shutdown (the server takes no new call): until every gateway and worker stream
        ended on its peer's side, or `grace_s`."""
        self._none_open = asyncio.Event()
        if self._open:
            try:
                await asyncio.wait_for(self._none_open.wait(), grace_s)
            except asyncio.TimeoutError:
                self.log.info("streams_ended_at_shutdown", streams=len(self._open))

    def end_streams(self, kind: type) -> None:
        """End the open streams of a `kind` (_GatewayStreamEnd: gateways, LoopOutbox: workers)
        from this side: each call completes and its peer reads the end (and goes elsewhere),
        where grpc's server stop would abort it and log a warning per call on a normal shutdown."""
        for writer in [w for w in self._open if isinstance(w, kind)]:
            writer.close()

    def _undecodable(self, method: str, msg, context) -> bool:
        """True (and the call will end INVALID_ARGUMENT) when `msg` did not decode."""
        if type(msg) is not Undecodable:
            return False
        if self.guard is not None and context is not None:
            self.guard.end_stream(f"/{SERVICE_NAME}/{method}", msg, context)
        return True

    @reads_undecodable
    async def Connect(self, request_iterator, context):
        session = GatewaySession()
        scope = f"{next(self._sessions):x}/"  # this stream's request-id namespace
        context.add_done_callback(lambda _: session.close())  # call over (client gone, server stopping): end the writer
        end = _GatewayStreamEnd(session)
        self._track(end, context)
        requests = request_iterator.__aiter__()
        first_read = asyncio.ensure_future(anext(requests, None))  # SessionOptions, if any, come first
        ended = end.wait()
        await asyncio.wait((first_read, ended), return_when=asyncio.FIRST_COMPLETED)
        ended.cancel()
        if not first_read.done():  # the scheduler is stopping before the gateway said anything
            first_read.cancel()
            return
        try:
            first = first_read.result()
        except Exception as exc:  # the gateway went away before its first message  # noqa: BLE001
            self.log.info("gateway_disconnected", error=repr(exc)[:200])
            return
        if first is not None and self._undecodable("Connect", first, context):
            return
        if first is not None and first.HasField("options"):
            try:
                session.plain_token_steps = limits.check_plain_token_steps(first.options.plain_token_steps)
            except limits.LimitError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            first = None
        reader = asyncio.get_running_loop().create_task(self._read_gateway(requests, session, scope, first, context))
        try:
            cut = len(scope)
            async for events in session.batches():
                for msg in event_batches(events, cut):
                    yield msg
        finally:
            if not reader.done():
                reader.cancel()  # its end closes the session in the engine

    async def _read_gateway(self, requests, session: GatewaySession, scope: str, first=None, context=None) -> None:
        engine = self.engine
        try:
            msg = first
            while True:
                if msg is None:
                    try:
                        msg = await anext(requests)
                    except StopAsyncIteration:
                        break
                    except Exception as exc:  # the gateway went away: its requests are aborted below  # noqa: BLE001
                        self.log.info("gateway_disconnected", error=repr(exc)[:200])
                        break
                    if type(msg) is Undecodable:
                        self._undecodable("Connect", msg, context)
                        break
                kind = msg.WhichOneof("kind")
                if kind == "submit":
                    await self._submit_on(session, msg.submit, scope)
                elif kind == "abort":
                    engine.abort(scope + msg.abort.request_id)  # only this stream's requests
                elif kind == "options":  # only as the first message: the stream ends
                    self.log.warning("gateway_protocol_error", error="options after the stream's first message")
                    break
                msg = None
        finally:
            engine.close_session(session)

    async def _submit_on(self, session: GatewaySession, msg: scheduler_pb2.SubmitRequest, scope: str) -> None:
        """Submit one request; whatever is wrong with it is answered to it alone (the engine
        answers what it refuses on the session itself)."""
        info = self.engine.worker
        try:
            if info is None:
                raise NoWorker("no worker attached yet")
            request = request_from_proto(msg, info, scope)
        except (RequestRejected, NoWorker) as exc:  # the scheduler's own check of the shared limits
            session.put_many([rejection(scope + msg.request_id, exc)])
        else:
            await self.engine.submit_async(request, session)

    async def GetStats(self, request, context):
        stats, per_replica = self.engine.stats()
        if stats is None:
            fields = scheduler_pb2.SchedulerStats.DESCRIPTOR.fields_by_name
            totals = {k: v for k, v in self.engine.carried_counts.items() if k in fields}
            return scheduler_pb2.SchedulerStats(worker_attached=False, **totals)
        msg = stats_to_proto(stats)
        msg.replicas.extend(scheduler_pb2.ReplicaStats(worker_id=name, stats=stats_to_proto(s))
                            for name, s in per_replica.items())
        return msg

    async def GetModel(self, request, context):
        info = self.engine.worker
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker attached yet")
        return codec.worker_info_to_proto(info)

    async def GetFlightRecord(self, request, context):
        lanes = self.engine.flight_records()
        return scheduler_pb2.FlightRecord(
            worker_id=",".join(name for name, _ in lanes),
            steps=[codec.step_record_to_proto(r) for _, records in lanes for r in records],
        )

    @reads_undecodable
    async def AttachWorker(self, request_iterator, context):
        requests = request_iterator.__aiter__()
        try:
            first = await anext(requests, None)
        except Exception as exc:  # the worker went away before its hello  # noqa: BLE001
            self.log.info("worker_stream_closed", error=repr(exc)[:200])
            return
        if first is not None and self._undecodable("AttachWorker", first, context):
            first = None
        if first is None or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a hello")
        try:
            info = codec.worker_info_from_proto(first.hello)
            limits.check_worker_info(info)
        except (ValueError, limits.LimitError) as exc:  # a LimitError is a ValueError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hello.{exc}")
        outbox = LoopOutbox()
        context.add_done_callback(lambda _: outbox.close())  # call over: end the writer
        self._track(outbox, context)
        handle = self.engine.attach_worker(info, outbox)
        reader = asyncio.get_running_loop().create_task(self._read_results(requests, handle, context))
        try:
            accepted = outbox.ACCEPTED
            async for plan in outbox:
                if plan is accepted:  # the engine made the worker a replica: tell it, before any plan
                    await context.send_initial_metadata((daemon.ATTACH_ACCEPTED,))
                    continue
                msg = scheduler_pb2.SchedulerMessage()
                codec.plan_to_proto(plan, msg.plan)  # in place: no copy of a finished plan message
                yield msg
        except asyncio.CancelledError:  # the call ended: let the reader take what the worker sent last (a detach)
            if not reader.done():
                await asyncio.wait([reader], timeout=1.0)
            raise
        finally:
            if not reader.done():
                reader.cancel()  # its end reports the loss to the engine
        if outbox.error is not None:  # refused or dropped: the worker learns why
            self.log.warning("worker_stream_closed", worker_id=info.worker_id, error=str(outbox.error))
            await context.abort(REFUSAL_STATUS[outbox.error.kind], str(outbox.error))

    async def JoinGroup(self, request, context):
        """Waits until the caller's tensor-parallel group is complete (see scheduler.proto)."""
        try:
            limits.check_group_place(request.tensor_parallel_size, 0)
            limits.check_id("worker_id", request.worker_id)
            limits.check_id("rendezvous_host", request.rendezvous_host)
            if request.tensor_parallel_size < 2:
                raise limits.LimitError("tensor_parallel_size", "must be >= 2 to form a group")
            if not 0 < request.rendezvous_port < 65536:
                raise limits.LimitError("rendezvous_port", f"must be in [1, 65535], got {request.rendezvous_port}")
        except limits.LimitError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        joiner = Joiner(request.worker_id, request.tensor_parallel_size,
                        request.rendezvous_host or peer_host(context.peer()), request.rendezvous_port,
                        notify=lambda: loop.call_soon_threadsafe(_settle, done))
        groups = self.engine.groups
        context.add_done_callback(lambda _: groups.cancel(joiner))  # caller gone: out of the queue
        groups.enqueue(joiner)
        try:
            await done
        finally:
            if joiner.assignment is None:
                groups.cancel(joiner)
        assignment = joiner.assignment
        if assignment is None:
            await context.abort(grpc.StatusCode.CANCELLED, "the call ended before its group was complete")
        self.log.info("group_joined", worker_id=request.worker_id, group_id=assignment.group_id,
                      rank=assignment.rank, world_size=assignment.world_size)
        return scheduler_pb2.GroupAssignment(
            group_id=assignment.group_id, rank=assignment.rank, world_size=assignment.world_size,
            master_addr=assignment.master_addr, master_port=assignment.master_port)

    async def _read_results(self, requests, handle: WorkerHandle, context=None) -> None:
        """Results up to the engine; a stream that the worker ends with a `detach` message is a
        worker leaving (info), anything else a loss (a warning; a killed worker's stream can
        end without an error here, and a reader cancelled at the call's end reports a loss)."""
        reason, error, clean = "the attach stream ended without a detach (the worker died or its connection broke)", \
            None, False
        on_result, tp_rank = handle.on_result, handle.info.tp_rank
        result_from_proto = codec.result_from_proto
        try:
            while True:
                try:
                    msg = await anext(requests)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # noqa: BLE001  the stream failed (reset, cancelled, ...)
                    reason = f"attach stream failed: {exc!r}"
                    break
                if type(msg) is Undecodable:
                    self._undecodable("AttachWorker", msg, context)
                    reason = "the worker sent a message that does not decode"
                    break
                kind = msg.WhichOneof("kind")
                if kind == "result":
                    if tp_rank:
                        reason = "a tensor-parallel rank other than 0 sent a result (only rank 0 reports)"
                        error = WorkerRefused(WorkerRefused.Kind.INVALID, reason)
                        break
                    try:
                        result = result_from_proto(msg.result)
                    except ValueError as exc:  # columns that do not line up, an id twice, ...
                        error = WorkerRefused(WorkerRefused.Kind.INVALID, reason := f"invalid step result: {exc}")
                        break
                    on_result(result)
                elif kind == "kv_loaded":
                    handle.on_kv_loaded(codec.kv_loaded_from_proto(msg.kv_loaded))
                elif kind == "grammar_ready":
                    if tp_rank:
                        reason = "a tensor-parallel rank other than 0 sent grammar_ready (only rank 0 reports)"
                        error = WorkerRefused(WorkerRefused.Kind.INVALID, reason)
                        break
                    ready = codec.grammar_ready_from_proto(msg.grammar_ready)
                    handle.on_grammar_ready(replace(ready, error=ready.error[:1000]))
                elif kind == "fatal_error":
                    reason = f"the worker failed: {msg.fatal_error[:1000]}"
                    break
                elif kind == "detach":
                    reason, clean = f"the worker detached: {msg.detach[:200]}", True
                    break
                else:
                    reason = "the worker sent something other than a result after its hello"
                    error = WorkerRefused(WorkerRefused.Kind.INVALID, reason)
                    break
        finally:
            handle.on_lost(reason, error, clean)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (`ipv4:10.0.0.5:4321`, `ipv6:[::1]:4321`)."""
    address = peer.split(":", 1)[1] if ":" in peer else peer
    return address.rsplit(":", 1)[0].strip("[]")


async def build_server(config: SchedulerDaemonConfig, log, on_fatal=lambda: None, freeze_heap: bool = False
                       ) -> tuple[grpc.aio.Server, SchedulerServicer, Engine, int]:  # freeze_heap: the daemon's own
    """The grpc.aio server, its servicer and the engine, on the running loop (the engine starts
    with `engine.start(loop)`, the server with `await server.start()`)."""
    config.check_exposure()
    num_speculative_tokens(config.speculative_config)  # a bad --speculative-config fails here, named
    loop = asyncio.get_running_loop()
    metrics = SchedulerMetrics(REGISTRY)
    refusals = security.Refusals(log, lambda method: metrics.internal_auth_refused.labels("scheduler", method).inc(),
                                 "internal_call_refused")
    interceptors = ([security.AioCredentialInterceptor(security.cluster_interceptor(config.cluster_token, refusals))]
                    if config.cluster_token else [])
    guard = AioUndecodableGuard(log)
    interceptors.append(guard)  # innermost: a refused credential never reads a message
    server = grpc.aio.server(interceptors=interceptors, options=[ports.EXCLUSIVE_PORT])
    health = daemon.AioHealth(server, [SERVICE_NAME], loop, reflect=config.enable_reflection)
    await health.set_async(False)
    options = replace(config.engine_options(), freeze_heap_on_attach=freeze_heap)
    engine = Engine(config.core_config, log, health.set, options, on_fatal, metrics)  # serving: a worker
    servicer = SchedulerServicer(engine, log, guard)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    tls = security.TLSFiles(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
    port = security.add_port(server, config.host, config.port, tls, "--port")
    return server, servicer, engine, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, SchedulerDaemonConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.from_args(SchedulerDaemonConfig, args)
    log = logs.configure("scheduler", config.log_level)
    daemon.tune_gil()  # the loop and grpc's poller thread hand each message over
    return asyncio.run(_serve(config, log))


async def _serve(config: SchedulerDaemonConfig, log, grace_s: float = 2.0) -> int:
    """The daemon on one event loop: the gRPC server, every stream and the engine."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        server, servicer, engine, port = await build_server(config, log, stop.set, freeze_heap=True)  # a dead engine ends it
        GcPauses(REGISTRY, "stepahead:gc_pause_seconds", log, config.gc_warning_threshold_secs)
    except (cfg.ConfigError, ValueError) as exc:
        log.error("bad_configuration", error=str(exc))
        return 2
    freeze_heap()
    engine.start(loop)
    await server.start()
    if config.metrics_port is not None:
        start_http_server(config.metrics_port, addr=config.host, registry=REGISTRY)
    log.info("scheduler_listening", address=f"{config.host}:{port}", pid=os.getpid())
    await stop.wait()
    stopping = asyncio.ensure_future(server.stop(2 * grace_s + 5))  # no new call; the open ones go on
    await servicer.wait_streams(grace_s)  # ... until their peers leave, or grace_s
    servicer.end_streams(_GatewayStreamEnd)
    engine.stop()
    try:
        await asyncio.wait_for(engine.stopped(), 5)
    except asyncio.TimeoutError:
        pass
    servicer.end_streams(LoopOutbox)  # after the engine: a worker's end is no loss to report
    await stopping
    return 1 if engine.crashed else 0
