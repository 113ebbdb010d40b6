"""The gateway's one multiplexed stream to the scheduler (`Scheduler.Connect`).

All of a gateway's requests share one bidirectional stream: submissions and aborts go up,
one `EventBatch` per scheduler step comes down and a reader thread hands each event (and
each packed plain token, `plain_tokens.py`) to its request's sink (a queue for the gRPC
servicer's threads, the event loop for HTTP). One message per step instead of one per
request per step keeps the control plane's CPU cost flat in the number of streams. If the
stream breaks, or the scheduler sends a malformed batch (the stream is then cancelled),
every open request fails with `LinkBroken` and the next submission opens a new stream
(`scheduler_pool.py` resubmits them elsewhere).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import grpc

from gateway.plain_tokens import MalformedBatch, OpenRequest, deliver
from stepahead import limits
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc


class LinkBroken(RuntimeError):
    """The stream to the scheduler ended while the request was open."""


class SchedulerLink:
    def __init__(self, channel: grpc.Channel, log, plain_token_steps: int = 1) -> None:
        """`plain_token_steps` > 1 (the gateway's --stream-interval): the scheduler may hold this
        link's plain tokens that many steps and send them in one batch (SessionOptions)."""
        self._stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self._log = log
        self._plain_token_steps = min(plain_token_steps, limits.MAX_PLAIN_TOKEN_STEPS)
        self._lock = threading.Lock()
        self._routes: dict[str, OpenRequest] = {}  # request id -> its event sink and counts
        self._outbox: queue.SimpleQueue | None = None  # messages for the current stream

    @property
    def num_open(self) -> int:
        """Requests open on this link (its load, as the gateway sees it)."""
        return len(self._routes)

    def submit(self, msg: scheduler_pb2.SubmitRequest, sink: Callable[[object], None]) -> None:
        """Send one request; its events (then `LinkBroken` if the stream breaks) go to `sink`.

        `sink` is called from the reader thread and must not block. Call `release` when
        the request's last event was seen (or it was given up) to drop its route.
        """
        with self._lock:
            if msg.request_id in self._routes:
                raise ValueError(f"request_id {msg.request_id!r} is already in flight on this gateway")
            outbox = self._open_stream()
            self._routes[msg.request_id] = OpenRequest(sink)
            outbox.put(scheduler_pb2.GatewayMessage(submit=msg))

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._routes and self._outbox is not None:
                abort = scheduler_pb2.AbortRequest(request_id=request_id)
                self._outbox.put(scheduler_pb2.GatewayMessage(abort=abort))

    def release(self, request_id: str) -> None:
        with self._lock:
            self._routes.pop(request_id, None)

    def _open_stream(self) -> queue.SimpleQueue:
        """The current stream's outbox, opening a stream if there is none (lock held)."""
        if self._outbox is None:
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            if self._plain_token_steps > 1:  # the stream's first message
                options = scheduler_pb2.SessionOptions(plain_token_steps=self._plain_token_steps)
                outbox.put(scheduler_pb2.GatewayMessage(options=options))
            responses = self._stub.Connect(iter(outbox.get, None))
            threading.Thread(target=self._read, args=(responses, outbox), name="scheduler-link", daemon=True).start()
            self._outbox = outbox
        return self._outbox

    def _read(self, responses, outbox: queue.SimpleQueue) -> None:
        reason = "the scheduler closed the stream"
        try:
            for batch in responses:
                deliver(batch, self._routes)
        except grpc.RpcError as exc:
            reason = f"the scheduler stream failed: {exc.code().name} {exc.details()}"
        except MalformedBatch as exc:  # like a message that does not parse: the stream is done
            reason = f"the scheduler sent a malformed EventBatch: {exc}"
            responses.cancel()
        with self._lock:
            if self._outbox is outbox:
                self._outbox = None
            open_routes = [r.sink for r in self._routes.values()]  # all of them belonged to this stream
        outbox.put(None)
        self._log.warning("scheduler_link_broken", reason=reason, open_requests=len(open_routes))
        for sink in open_routes:
            sink(LinkBroken(reason))
