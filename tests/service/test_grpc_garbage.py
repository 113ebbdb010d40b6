"""Garbage on the public gRPC port costs the gateway a counter, not a log line each: bytes
that do not decode as a request are answered INVALID_ARGUMENT, counted in
`stepahead:gateway_grpc_undecodable_messages_total{method}` and logged rate-limited with no
traceback (grpc itself logs an error with a traceback per message); health's `List` answers
instead of raising NotImplementedError."""

from __future__ import annotations

import random
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testing.launcher import ServeProcess
from tests.fixtures_models import tiny_model_dir  # noqa: F401

CALLS = 200
METHOD = "/stepahead.v1.Generation/Generate"


def _garbage(rng: random.Random) -> bytes:
    """A field-1 length prefix longer than what follows: never a whole message."""
    tail = bytes(rng.randrange(256) for _ in range(rng.randint(0, 20)))
    return b"\x0a" + bytes([len(tail) + 1 + rng.randrange(100)]) + tail


def _undecodable_count(http_url: str) -> float:
    text = urllib.request.urlopen(http_url + "/metrics", timeout=10).read().decode()
    want = f'stepahead:gateway_grpc_undecodable_messages_total{{method="{METHOD}"}}'
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(want)), 0.0)


def test_garbage_messages_are_refused_counted_and_logged_rate_limited(tiny_model_dir):  # noqa: F811
    rng = random.Random(0)
    with ServeProcess(tiny_model_dir, capture_stderr=True) as serve:
        with grpc.insecure_channel(serve.gateway_addr) as channel:
            generate = channel.unary_stream(METHOD)  # no serializer: the bytes go as they are
            codes = []
            for _ in range(CALLS):
                with pytest.raises(grpc.RpcError) as info:
                    list(generate(_garbage(rng), timeout=10))
                codes.append(info.value.code())
            listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * CALLS
        assert listed.statuses[""].status == health_pb2.HealthCheckResponse.SERVING
        deadline = time.monotonic() + 30
        while (count := _undecodable_count(serve.http_url)) != CALLS and time.monotonic() < deadline:
            time.sleep(0.1)  # poll interval of the scrape
        assert count == CALLS
    lines = [line for line in serve.stderr_lines if '"daemon": "gateway"' in line]
    undecodable = [line for line in serve.stderr_lines if "grpc_message_undecodable" in line]
    assert 1 <= len(undecodable) <= 2, undecodable  # one line per 10 s, however many messages
    assert not [line for line in serve.stderr_lines if "Traceback" in line or "raised by servicer" in line]
    assert serve.log_problems([r'"event": "grpc_message_undecodable"']) == []
    assert len(lines) <= 5, lines
