"""Helpers every daemon shares: health + reflection wiring and a signal-driven main loop."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as _AioHealthServicerBase
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Initial metadata of AttachWorker once the scheduler made the worker a replica.
ATTACH_ACCEPTED = ("stepahead-attach", "accepted")


class _HealthServicer(health.HealthServicer):
    """grpcio-health's servicer with `List`, which it leaves to raise NotImplementedError (an
    error line with a traceback per call, on a service that needs no credential)."""

    def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        with self._lock:
            statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})


class Health:
    """gRPC health for the overall server ("") and each named service; server reflection of
    them too when `reflect` (public services; internal ones only when asked for)."""

    def __init__(self, server: grpc.Server, services: Iterable[str], reflect: bool = True) -> None:
        self.servicer = _HealthServicer()
        self.services = ("", *services)
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        if reflect:
            reflection.enable_server_reflection((*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
        self.set(False)

    def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services:
            self.servicer.set(name, status)


class _AioHealthServicer(_AioHealthServicerBase):
    """grpcio-health's asyncio servicer with `List` (see `_HealthServicer`)."""

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()})


class AioHealth:
    """`Health` on a grpc.aio server whose loop is `loop`: `set` from that loop (it queues
    the change as a task there, in call order) or from any other thread (it waits for it).
    Call `await set_async(False)` before the server starts."""

    def __init__(self, server: grpc.aio.Server, services: Iterable[str], loop: asyncio.AbstractEventLoop,
                 reflect: bool = True) -> None:
        self.servicer = _AioHealthServicer()
        self.services = ("", *services)
        self.loop = loop
        self._changes: list = []  # queued on the loop, applied in order by one task at a time
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        if reflect:
            reflection.enable_server_reflection((*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)

    async def set_async(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services:
            await self.servicer.set(name, status)

    def set(self, serving: bool, timeout_s: float = 5.0) -> None:
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            asyncio.run_coroutine_threadsafe(self.set_async(serving), self.loop).result(timeout_s)
            return
        self._changes.append(serving)
        if len(self._changes) == 1:
            self.loop.create_task(self._apply())

    async def _apply(self) -> None:
        while self._changes:
            await self.set_async(self._changes[0])
            self._changes.pop(0)


def tune_gil(switch_interval_s: float = 0.0005) -> None:
    """A daemon's hot thread (the engine, the step launcher) hands work to gRPC threads many
    times per step; with CPython's default 5 ms switch interval each hand-off can stall
    that long. A shorter interval keeps hand-offs in the sub-millisecond range."""
    sys.setswitchinterval(switch_interval_s)


def install_stop_handlers() -> threading.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def serve_until_stopped(server: grpc.Server, stop: threading.Event, grace_s: float = 2.0) -> None:
    stop.wait()
    server.stop(grace_s).wait()


def wait_channel_ready(channel: grpc.Channel, timeout_s: float) -> None:
    """Block until `channel` reaches a server; grpc.FutureTimeoutError after `timeout_s`. A
    health call with wait_for_ready (any answer, an error status included, means a server is
    there), not `grpc.channel_ready_future`: that future's connectivity-polling thread can
    outlive the channel its caller closes next and die of "Cannot monitor channel state:
    Channel closed!" (seen re-attaching to a dead scheduler)."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s,
                                                  wait_for_ready=True)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise grpc.FutureTimeoutError() from None
