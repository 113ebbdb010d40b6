"""The gateway's one multiplexed stream to the scheduler (`Scheduler.Connect`).

All of a gateway's requests share one bidirectional stream: submissions and aborts go up,
one `EventBatch` per scheduler step comes down, and the link hands each event (and each
packed plain token, `plain_tokens.py`) to its request's sink. One message per step instead
of one per request per step keeps the control plane's CPU cost flat in the number of streams.

The stream is a `grpc.aio` call on the event loop of the gateway's public gRPC server
(`grpc_thread.py`): a step's batch is read, and its events put into the gRPC servicers'
mailboxes, on the thread that then streams them to the clients, with no thread of the
link's own and no hand-off between threads on the per-token path (the HTTP server's
requests get theirs through `event_stream.LoopEvents`, one wake-up of its loop per batch).
`submit`, `abort` and `release` may be called from any thread.

If the stream breaks, or the scheduler sends a malformed batch (the stream is then
cancelled), every request that went out on it fails with `LinkBroken` and the next
submission opens a new stream (`scheduler_pool.py` resubmits them elsewhere).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import grpc

from gateway.plain_tokens import MalformedBatch, OpenRequest, deliver
from stepahead import limits
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc


class LinkBroken(RuntimeError):
    """The stream to the scheduler ended while the request was open."""


class _Stream:
    """One `Connect` call: its messages to send (None ends them) and its reader task."""

    __slots__ = ("outbox", "call", "reader")

    def __init__(self) -> None:
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.call = None
        self.reader: asyncio.Task | None = None

    async def messages(self):
        while (msg := await self.outbox.get()) is not None:
            yield msg


class SchedulerLink:
    def __init__(self, open_channel: Callable[[], grpc.aio.Channel], loop: asyncio.AbstractEventLoop, log,
                 plain_token_steps: int = 1, metadata: Sequence[tuple[str, str]] = ()) -> None:
        """`open_channel()` makes the `grpc.aio` channel to the scheduler (on `loop`, at the
        first submission); `metadata` goes with the stream (the cluster token).
        `plain_token_steps` > 1 (the gateway's --stream-interval): the scheduler may hold this
        link's plain tokens that many steps and send them in one batch (SessionOptions)."""
        self._open_channel = open_channel
        self._loop = loop
        self._log = log
        self._metadata = tuple(metadata)
        self._plain_token_steps = min(plain_token_steps, limits.MAX_PLAIN_TOKEN_STEPS)
        self._lock = threading.Lock()
        self._routes: dict[str, OpenRequest] = {}  # request id -> its event sink and counts
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._stream: _Stream | None = None  # the open stream (loop only)
        self._closing = False

    @property
    def num_open(self) -> int:
        """Requests open on this link (its load, as the gateway sees it)."""
        return len(self._routes)

    def submit(self, msg: scheduler_pb2.SubmitRequest, sink: Callable[[object], None]) -> None:
        """Send one request; its events (then `LinkBroken` if the stream breaks) go to `sink`,
        called on the link's event loop (it must not block). Call `release` when the
        request's last event was seen (or it was given up) to drop its route."""
        with self._lock:
            if msg.request_id in self._routes:
                raise ValueError(f"request_id {msg.request_id!r} is already in flight on this gateway")
            self._routes[msg.request_id] = OpenRequest(sink)
        self._on_loop(self._send, msg)

    def abort(self, request_id: str) -> None:
        route = self._routes.get(request_id)  # taken now: a `release` may follow before the loop sends it
        if route is not None:
            self._on_loop(self._abort, (request_id, route))

    def release(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the channel (at shutdown, from a thread other than the loop's): the open
        requests end with `LinkBroken`, and nothing is logged for it."""
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout_s)

    def _on_loop(self, fn: Callable[[object], None], arg: object) -> None:
        if asyncio._get_running_loop() is self._loop:
            fn(arg)
        else:
            self._loop.call_soon_threadsafe(fn, arg)

    def _send(self, msg: scheduler_pb2.SubmitRequest) -> None:
        route = self._routes.get(msg.request_id)
        if route is None or self._closing:
            return  # released before it went out (its client is gone), or shutting down
        stream = self._stream or self._open_stream()
        route.stream = stream
        stream.outbox.put_nowait(scheduler_pb2.GatewayMessage(submit=msg))

    def _abort(self, request: tuple[str, OpenRequest]) -> None:
        request_id, route = request
        if route.stream is not None and route.stream is self._stream:  # None: it never went out
            self._stream.outbox.put_nowait(
                scheduler_pb2.GatewayMessage(abort=scheduler_pb2.AbortRequest(request_id=request_id)))

    def _open_stream(self) -> _Stream:
        if self._channel is None:
            self._channel = self._open_channel()
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        stream = _Stream()
        if self._plain_token_steps > 1:  # the stream's first message
            options = scheduler_pb2.SessionOptions(plain_token_steps=self._plain_token_steps)
            stream.outbox.put_nowait(scheduler_pb2.GatewayMessage(options=options))
        stream.call = self._stub.Connect(stream.messages(), metadata=self._metadata)
        stream.reader = self._loop.create_task(self._read(stream))
        self._stream = stream
        return stream

    async def _read(self, stream: _Stream) -> None:
        reason = "the scheduler closed the stream"
        call, routes = stream.call, self._routes
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:
                deliver(batch, routes)
        except grpc.aio.AioRpcError as exc:
            reason = f"the scheduler stream failed: {exc.code().name} {exc.details()}"
        except MalformedBatch as exc:  # like a message that does not parse: the stream is done
            reason = f"the scheduler sent a malformed EventBatch: {exc}"
            call.cancel()
        except asyncio.CancelledError:  # grpc.aio's read of a cancelled call (`close`)
            if not call.cancelled():
                raise  # the task itself
            reason = "the gateway closed its link to the scheduler"
        with self._lock:
            if self._stream is stream:
                self._stream = None
            broken = [r.sink for r in routes.values() if r.stream is stream]
        stream.outbox.put_nowait(None)
        if not self._closing:
            self._log.warning("scheduler_link_broken", reason=reason, open_requests=len(broken))
        for sink in broken:
            sink(LinkBroken(reason))

    async def _close(self) -> None:
        self._closing = True
        stream = self._stream
        if self._channel is not None:
            await self._channel.close(grace=None)
        if stream is not None and stream.reader is not None:
            await asyncio.gather(stream.reader, return_exceptions=True)
