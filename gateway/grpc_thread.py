"""The gateway's event loop on its own thread: the public gRPC server (`grpc.aio`), the
scheduler links and uvicorn's HTTP server all run on it.

Why asyncio and not grpc's thread-per-stream server: the threaded server takes a new call
from grpc core only when its one polling thread gets the GIL, which a thousand streaming
threads hold most of the time. Under a burst the new calls wait inside grpc core, which
sheds them with a bare CANCELLED (its pending-call backlog: random drops past 1000 calls,
all past 3000, and any call not taken within 30 s) before the gateway's own stream limit
ever sees them. On an event loop a call is taken (and admitted, or refused with
RESOURCE_EXHAUSTED) as soon as the loop comes round, and a stream costs no thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from stepahead.daemon import HEALTH_SERVICE

# grpc core's pending-call backlog (calls that arrived but the application has not taken
# yet): never shed there, silently; the gateway's stream gate answers every call instead,
# and a call waits no longer than its client's own deadline (DEADLINE_EXCEEDED).
NO_BACKLOG_SHEDDING = (
    ("grpc.server.max_pending_requests", 1 << 30),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 30),
    ("grpc.server_max_unrequested_time_in_server", 1 << 30),  # seconds
)


KEEPALIVE_S = 60
KEEPALIVE_TIMEOUT_S = 20
KEEPALIVE_MIN_PING_S = 10


def connection_options(max_connections: int, handshake_timeout_s: float, max_idle_s: float) -> tuple:
    """Connection limits of the public server: a cap below the fd limit (grpc core closes a
    connection past it at once, instead of failing accept() and retrying in a loop), a
    deadline for a new connection's (TLS) handshake, connections without calls closed, and
    keepalive pings that find dead peers. Pings from clients are allowed no more often than
    every `KEEPALIVE_MIN_PING_S`, with or without open calls."""
    return (
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(max_idle_s * 1000)),
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MIN_PING_S * 1000),
    )


class _HealthServicer(HealthServicer):
    """grpcio-health's servicer with `List`, which it leaves to raise NotImplementedError
    (an error line with a traceback per call, a log any client could flood)."""

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()})


class AioHealth:
    """gRPC health (overall "" and each named service) and reflection on a grpc.aio server;
    `set` may be called from any thread."""

    def __init__(self, server: grpc.aio.Server, services: tuple[str, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.servicer = _HealthServicer()
        self.services = ("", *services)
        self.loop = loop
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection((*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)

    async def set_async(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services:
            await self.servicer.set(name, status)

    def set(self, serving: bool, timeout_s: float = 5.0) -> None:
        asyncio.run_coroutine_threadsafe(self.set_async(serving), self.loop).result(timeout_s)


class GrpcThread:
    """A fresh event loop in a thread, the gateway's one loop: the public gRPC server's, the
    scheduler links' and the HTTP server's (`http_server.HttpServer`); `loop` exists before
    `start`. `start(build)` runs `build(loop)` (a coroutine returning the unstarted server, its
    `AioHealth` and the bound port) there and starts the server NOT_SERVING."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._stopped = self.loop.create_future()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._until_stopped(),),
                                        name="grpc-aio", daemon=True)
        self._thread.start()
        self.server: grpc.aio.Server | None = None
        self.health: AioHealth | None = None
        self.port = 0

    def start(self, build: Callable[[asyncio.AbstractEventLoop], Awaitable[tuple]], timeout_s: float = 30.0) -> int:
        asyncio.run_coroutine_threadsafe(self._start(build), self.loop).result(timeout_s)
        return self.port

    async def _start(self, build: Callable[[asyncio.AbstractEventLoop], Awaitable[tuple]]) -> None:
        self.server, self.health, self.port = await build(self.loop)
        await self.health.set_async(False)
        await self.server.start()

    async def _until_stopped(self) -> None:
        """The loop's root task (run with `run_until_complete`, not `run_forever`): anyio, under
        FastAPI's thread offloads, finds it at once and ends its worker threads with it; with
        no such task it searches every task of the loop on each offload."""
        await self._stopped

    def stop(self, grace_s: float = 2.0) -> None:
        """Cancel what is still open after `grace_s`, then end the loop and its thread."""
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop).result(grace_s + 10)
        self.loop.call_soon_threadsafe(self._stopped.set_result, None)
        self._thread.join(10)
        self.loop.close()
