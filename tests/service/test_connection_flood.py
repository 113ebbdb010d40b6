"""Idle TCP connections past the gateway's connection cap (a small `--max-connections`
here) lock nobody out: a new request is served or cleanly refused within a second, open
streams finish whole, idle connections are dropped after `--http-request-timeout`, and the
log says so a few times at most, never a line per connection. (grpc core keeps a TCP
connection that never sends its HTTP/2 preface until the cap is reached: the cap is what
bounds those.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import grpc
import httpx2 as httpx
import pytest

from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve

CAP = 40
FLOOD = 150
REQUEST_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def capped(tiny_model_dir):  # noqa: F811
    with Serve(tiny_model_dir, "--max-connections", str(CAP), "--http-request-timeout", str(REQUEST_TIMEOUT_S),
               capture_stderr=True) as s:
        yield s


def _flood(address: tuple[str, int], count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(address)
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def _closed(socks: list[socket.socket], wait_s: float) -> int:
    """How many of `socks` the server has closed (EOF or reset) within `wait_s`."""
    deadline, closed = time.monotonic() + wait_s, 0
    for s in socks:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            closed += s.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            closed += 1
        except (TimeoutError, socket.timeout):
            pass
    return closed


def _stream(capped, out: list, started: threading.Semaphore) -> None:
    """One streamed completion: (status, completion tokens, finish reason, [DONE] seen)."""
    body = {"prompt": "Hello", "max_tokens": 48, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    tokens, finish, done, under_way = 0, None, False, False
    with httpx.stream("POST", capped.http_url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                if not under_way:
                    under_way = True
                    started.release()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
        out.append((response.status_code, tokens, finish, done))


def test_flood_past_the_cap(capped) -> None:
    url = urlparse(capped.http_url)
    http_addr = (url.hostname, url.port)
    host, port = capped.gateway_addr.rsplit(":", 1)
    capped.gateway.ListModels(generation_pb2.ListModelsRequest(), timeout=10)  # its connection opens first
    streams: list = []
    started = threading.Semaphore(0)
    stream_threads = [threading.Thread(target=_stream, args=(capped, streams, started)) for _ in range(3)]
    for t in stream_threads:
        t.start()
    for _ in stream_threads:  # the streams are under way before the flood
        assert started.acquire(timeout=30)
    http_held = _flood(http_addr, FLOOD)
    held = http_held + _flood((host, int(port)), FLOOD)
    try:
        assert _closed(http_held[CAP:], 1.0) == len(http_held[CAP:])  # past the cap: closed at once
        start = time.monotonic()
        try:
            status = httpx.get(capped.http_url + "/v1/models", timeout=5).status_code
        except httpx.TransportError:
            status = None  # refused: reset or closed at once
        assert time.monotonic() - start < 1.0
        assert status in (None, 200)
        with grpc.insecure_channel(capped.gateway_addr) as ch:  # a new connection, past the cap
            start = time.monotonic()
            try:
                generation_pb2_grpc.GenerationStub(ch).ListModels(generation_pb2.ListModelsRequest(), timeout=5)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            assert time.monotonic() - start < 1.0
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
        reply = capped.gateway.Generate(generation_pb2.GenerateRequest(  # an open connection keeps working
            text="Hi", sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=10)
        assert sum(1 for _ in reply) >= 1
        for t in stream_threads:
            t.join(60)
        assert streams == [(200, 48, "length", True)] * 3
        assert _closed(http_held, REQUEST_TIMEOUT_S + 2) == len(http_held)  # the idle ones are dropped
        grpc_held = held[len(http_held):]  # grpc core closed the ones past its cap at once
        assert _closed(grpc_held, 0.5) >= len(grpc_held) - CAP
        assert httpx.get(capped.http_url + "/v1/models", timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()
    with grpc.insecure_channel(capped.gateway_addr) as ch:
        generation_pb2_grpc.GenerationStub(ch).ListModels(generation_pb2.ListModelsRequest(), timeout=10)
    for _ in range(30):  # malformed requests: each answered 400, not each logged
        with socket.create_connection(http_addr, timeout=5) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert b" 400 " in s.recv(256)
    time.sleep(0.5)
    assert sum("Invalid HTTP" in line for line in capped.stderr_lines) <= 2
    lines = [line for line in capped.stderr_lines if "connection" in line or "accept" in line or "descriptor" in line]
    assert len(lines) <= 6, lines
    assert all(line.lstrip().startswith("{") for line in lines), lines


def test_an_oversized_request_head_is_refused_and_closed(capped) -> None:
    """A request head past the gateway's limit (16 KiB) is answered 400 and its connection
    closed while the head is still incomplete: a client cannot make the gateway buffer headers
    without end. (A server without the limit would wait for the rest of the head: no reply.)"""
    url = urlparse(capped.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        try:  # 64 KiB of header lines, never the blank line that ends a head
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n" + b"X-Pad: " + b"a" * (64 << 10) + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while still sending
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    with httpx.Client(timeout=60) as client:  # and it serves the next client, a head of 12 KiB included
        assert client.get(capped.http_url + "/health", headers={"x-pad": "a" * (12 << 10)}).status_code == 200


def test_a_pipelined_request_streams_past_the_request_deadline(capped) -> None:
    """Two requests sent back to back on one connection: the second, a stream that outlasts
    `--http-request-timeout`, arrived whole before the first was answered, so no deadline may
    cut it (the deadline is for a request still arriving)."""
    url = urlparse(capped.http_url)
    body = json.dumps({"prompt": "Hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    started = time.monotonic()
    with socket.create_connection((url.hostname, url.port), timeout=120) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"
                  b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        reply = b""
        while not reply.endswith(b"data: [DONE]\r\n\r\n\r\n0\r\n\r\n") and (chunk := s.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1 200") == 2, reply[:300]
    assert reply.endswith(b"data: [DONE]\r\n\r\n\r\n0\r\n\r\n"), reply[-300:]  # the stream ended whole
    assert time.monotonic() - started > REQUEST_TIMEOUT_S  # it did outlast the deadline
