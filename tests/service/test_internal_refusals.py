"""Refused internal-plane calls are seen: a real scheduler daemon (no worker needed) answers
calls without the cluster token UNAUTHENTICATED, counts each in
`stepahead:internal_auth_refused_total{daemon,method}`, and logs them rate-limited (a flood of
refusals writes a line per interval naming the peer, never a line per call)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from stepahead import security
from stepahead.ports import free_ports
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

TOKEN = "the-cluster-token"
CALLS = 60
METHOD = "/stepahead.v1.Scheduler/GetStats"


@pytest.fixture()
def scheduler(tmp_path):
    port, metrics_port = free_ports(2)
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "scheduler", "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", str(metrics_port), "--cluster-token", TOKEN],
            stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        yield f"127.0.0.1:{port}", metrics_port, log_path, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _refused_metric(metrics_port: int, method: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    except OSError:  # not listening yet
        return None
    want = f'stepahead:internal_auth_refused_total{{daemon="scheduler",method="{method}"}}'
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_listening(address: str, proc, timeout_s: float = 60.0) -> None:
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise AssertionError(f"scheduler not listening on {address} (exit {proc.poll()})") from None


def test_refused_internal_calls_are_counted_and_logged_rate_limited(scheduler):
    address, metrics_port, log_path, proc = scheduler
    _wait_listening(address, proc)
    codes = []
    with security.channel(address) as channel:  # no cluster token
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for _ in range(CALLS):
            with pytest.raises(grpc.RpcError) as info:
                stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
            codes.append(info.value.code())
        with pytest.raises(grpc.RpcError) as info:  # a streaming method is refused and counted too
            next(stub.Connect(iter([scheduler_pb2.GatewayMessage(
                abort=scheduler_pb2.AbortRequest(request_id="x"))])))
        codes.append(info.value.code())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * (CALLS + 1)

    deadline = time.monotonic() + 30
    while (count := _refused_metric(metrics_port, METHOD)) != CALLS and time.monotonic() < deadline:
        time.sleep(0.1)  # poll interval of the scrape
    assert count == CALLS
    assert _refused_metric(metrics_port, "/stepahead.v1.Scheduler/Connect") == 1

    with security.channel(address, cluster_token=TOKEN) as channel:  # the right token is not counted
        scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    assert _refused_metric(metrics_port, METHOD) == CALLS

    proc.terminate()
    proc.wait(timeout=30)
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    refused = [e for e in lines if e.get("event") == "internal_call_refused"]
    assert 1 <= len(refused) <= 2, refused  # one line per 10 s interval, however many calls
    first = refused[0]
    assert first["level"] == "warning" and first["method"] == METHOD
    assert first["peer"].startswith(("ipv4:127.0.0.1:", "ipv6:[::1]:")), first
    assert sum(e["not_logged_since_last"] + 1 for e in refused) <= CALLS + 1
    assert not [e for e in lines if e.get("level") in ("error", "critical") or "Traceback" in json.dumps(e)]


def test_garbage_to_the_unauthenticated_health_service_is_refused_quietly(scheduler):
    """Health needs no credential, so anyone reaching the port can send it bytes: each one is
    INVALID_ARGUMENT, List answers, and the log gets one rate-limited line, no traceback.
    Garbage to a guarded method without the token is still refused for the token first."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address, _, log_path, proc = scheduler
    _wait_listening(address, proc)
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        codes = []
        for i in range(100):
            with pytest.raises(grpc.RpcError) as info:
                check(b"\xff\xff\xff garbage %d" % i, timeout=10)
            codes.append(info.value.code())
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 100
        listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
        assert "" in listed.statuses
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/stepahead.v1.Scheduler/GetStats")(b"\xff\xff garbage", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    proc.terminate()
    proc.wait(timeout=30)
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    problems = [line for line in lines if json.loads(line)["level"] not in ("debug", "info")]
    assert [json.loads(line)["event"] for line in problems] == ["grpc_message_undecodable", "internal_call_refused"]
    assert not any("Traceback" in line for line in lines), lines
