"""Helpers the service tests share: a long greedy stream that must survive whatever else
is sent, a raw Connect session on the scheduler, waiting for health or for an idle pool."""

from __future__ import annotations

import contextlib

import functools
import queue
import threading
import time
from concurrent.futures import Future

import grpc

from gateway.plain_tokens import OpenRequest, deliver
from stepahead.v1 import common_pb2, generation_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.model.oracle import assert_matches_hf

LONG_PROMPT = [5, 17, 300, 41, 7, 1000, 23, 99]


def greedy(ids, max_tokens: int) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling)


class LongStream:
    """A greedy stream running in the background; `check(hf)` asserts it finished whole and
    token for token what Hugging Face generates."""

    def __init__(self, stub, max_tokens: int = 400, prompt: list[int] = LONG_PROMPT) -> None:
        self.prompt, self.max_tokens = prompt, max_tokens
        self.started = threading.Event()
        self._result: Future = Future()
        threading.Thread(target=self._run, args=(stub,), daemon=True).start()
        assert self.started.wait(120), "the long stream never produced a token"

    def _run(self, stub) -> None:
        tokens, last = [], None
        try:
            for msg in stub.Generate(greedy(self.prompt, self.max_tokens), timeout=300):
                tokens += msg.token_ids
                last = msg
                self.started.set()
            self._result.set_result((tokens, last))
        except BaseException as exc:  # handed to check()
            self.started.set()
            self._result.set_exception(exc)

    def check(self, hf) -> None:
        tokens, last = self._result.result(timeout=300)
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, last
        assert len(tokens) == self.max_tokens
        want, gaps = hf.generate(self.prompt, self.max_tokens)
        assert_matches_hf(tokens, want, gaps, "the concurrent long stream")


class _EveryId(dict):
    """Routes for `plain_tokens.deliver` that take every request id the scheduler names (a
    gateway's link routes only its open ones)."""

    def __init__(self, on_event) -> None:
        super().__init__()
        self._on_event = on_event

    def get(self, request_id: str, default=None) -> OpenRequest:
        route = dict.get(self, request_id)
        if route is None:
            route = self[request_id] = OpenRequest(functools.partial(self._on_event, request_id))
        return route


class ConnectSession:
    """A Connect stream opened by the test as a gateway would: submit raw SubmitRequests and
    collect each request's events until its final or rejected one."""

    def __init__(self, channel) -> None:
        self._outbox: queue.Queue = queue.Queue()
        self._responses = scheduler_pb2_grpc.SchedulerStub(channel).Connect(iter(self._outbox.get, None))
        self._events: dict[str, list] = {}
        self._done: dict[str, threading.Event] = {}
        self._any: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def submit(self, msg: scheduler_pb2.SubmitRequest) -> None:
        with self._lock:
            self._events.setdefault(msg.request_id, [])
            self._done.setdefault(msg.request_id, threading.Event())
            self._any.setdefault(msg.request_id, threading.Event())
        self._outbox.put(scheduler_pb2.GatewayMessage(submit=msg))

    def _read(self) -> None:
        try:
            self._route(self._responses)
        except grpc.RpcError as exc:  # closed by close(), or the scheduler went away
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise

    def _route(self, responses) -> None:
        routes = _EveryId(self._on_event)
        for batch in responses:
            deliver(batch, routes)  # the gateway's own reader: events, then the packed plain tokens

    def _on_event(self, request_id: str, event) -> None:
        with self._lock:
            self._events.setdefault(request_id, []).append(event)
            done = self._done.setdefault(request_id, threading.Event())
            self._any.setdefault(request_id, threading.Event()).set()
        if event.rejected or event.finish_reason:
            done.set()

    def last_event(self, request_id: str, timeout_s: float = 120):
        assert self._done[request_id].wait(timeout_s), f"no final event for {request_id}"
        return self._events[request_id][-1]

    def first_event(self, request_id: str, timeout_s: float = 120):
        assert self._any[request_id].wait(timeout_s), f"no event for {request_id}"
        return self._events[request_id][0]

    def finished(self, request_id: str) -> bool:
        """Whether the request's final (or rejected) event has arrived."""
        return self._done[request_id].is_set()

    def close(self) -> None:
        self._outbox.put(None)
        self._responses.cancel()


def wait_health(address: str, serving: bool, timeout_s: float = 120.0, channel: grpc.Channel | None = None) -> None:
    """Follow the health Watch stream until the server reports `serving` (no polling); over
    `channel` when given (e.g. a TLS one), else a plaintext channel to `address`."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    want = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    with contextlib.nullcontext(channel) if channel is not None else grpc.insecure_channel(address) as channel:
        updates = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
        )
        for update in updates:
            if update.status == want:
                updates.cancel()
                return
    raise AssertionError(f"{address} never reported serving={serving}")


def wait_idle(serve, timeout_s: float = 5.0):
    """The scheduler's stats once nothing runs or waits and every block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = serve.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        assert time.monotonic() < deadline, f"not idle within {timeout_s} s: {stats}"


def wait_active_requests(serve, count: int, timeout_s: float = 30.0) -> str:
    """The gateway's metrics text once its `active_requests` gauge reads `count`. A client's
    close or cancel returns before the gateway handled it on its own loop, so the slot comes
    back a moment later; one that leaked never does."""
    import urllib.request

    deadline, pause = time.monotonic() + timeout_s, threading.Event()
    while True:
        with urllib.request.urlopen(serve.http_url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        line = next(line for line in metrics.splitlines() if line.startswith("stepahead:gateway_active_requests "))
        if float(line.split()[1]) == count:
            return metrics
        assert time.monotonic() < deadline, line
        pause.wait(0.05)
