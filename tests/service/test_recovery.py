"""A gateway that dies mid-generation: its requests are aborted and free their blocks
(daemons started one by one, as an operator would). A dying worker's requests move to
another replica: `test_replicas.py`."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testing.launcher import DaemonLogs
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.streams import wait_health


def wait_serving(address: str, timeout_s: float = 120.0) -> None:
    """Follow the health Watch stream until SERVING (no polling)."""
    with grpc.insecure_channel(address) as channel:
        updates = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
        )
        for update in updates:
            if update.status == health_pb2.HealthCheckResponse.SERVING:
                updates.cancel()
                return
    raise AssertionError(f"{address} not serving")


@pytest.fixture
def daemons(tiny_model_dir):  # noqa: F811
    """(the daemons by name, the scheduler's and the gateway's addresses, their logs): at
    teardown no daemon may have logged a warning or above but what `logs.expected` names."""
    sched_port, gw_port, http_port = free_port(), free_port(), free_port()
    sched = f"127.0.0.1:{sched_port}"
    logs = DaemonLogs()
    spawn = logs.spawn
    procs = {"scheduler": spawn("scheduler", "--port", str(sched_port))}
    procs["worker"] = spawn("worker", "--scheduler", sched, "--model", str(tiny_model_dir))
    procs["gateway"] = spawn("gateway", "--scheduler", sched, "--port", str(gw_port), "--http-port", str(http_port),
                             "--model", str(tiny_model_dir), "--drain-timeout", "5")
    procs["http"] = f"http://127.0.0.1:{http_port}"
    try:
        wait_serving(sched)
        wait_serving(f"127.0.0.1:{gw_port}")
        yield procs, sched, f"127.0.0.1:{gw_port}", logs
    finally:
        daemons_ = [p for p in procs.values() if isinstance(p, subprocess.Popen)]
        for p in daemons_:
            if p.poll() is None:
                p.terminate()
        for p in daemons_:
            p.wait(timeout=30)
    problems = logs.problems()
    assert not problems, problems


def test_worker_death_requests_wait_and_resume_on_a_new_worker(daemons, tiny_model_dir):  # noqa: F811
    """The only worker dies mid-stream: /health says 503 while none is attached, the request
    waits (--worker-wait-timeout) instead of failing, and resumes on the next worker."""
    procs, sched, gateway, logs = daemons
    gw = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway))
    sched_stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(sched))
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    call = gw.Generate(generation_pb2.GenerateRequest(text="while True:", sampling=sampling), timeout=300)
    first = next(call)
    assert first.token_ids
    rest: list = []
    reader = threading.Thread(target=lambda: rest.extend(call), daemon=True)
    reader.start()
    assert httpx.get(procs["http"] + "/health", timeout=10).status_code == 200
    # the scheduler logs the loss: a killed worker never sent a detach, however its stream ended
    logs.expected = [r'"daemon": "scheduler".*"event": "worker_lost"']
    procs["worker"].send_signal(signal.SIGKILL)
    procs["worker"].wait(timeout=30)
    wait_health(sched, serving=False)
    assert httpx.get(procs["http"] + "/health", timeout=10).status_code == 503  # no worker attached

    procs["worker"] = logs.spawn("worker", "--scheduler", sched, "--model", str(tiny_model_dir))
    wait_serving(sched)
    reader.join(timeout=300)
    assert rest and rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 200  # no gap, none twice
    assert httpx.get(procs["http"] + "/health", timeout=10).status_code == 200
    stats = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert any('"event": "worker_lost"' in line for line in logs.lines if line.startswith("[scheduler "))


def test_a_dead_gateway_aborts_its_requests(daemons):
    procs, sched, gateway, logs = daemons
    gw = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(gateway))
    sched_stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(sched))
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    call = gw.Generate(generation_pb2.GenerateRequest(text="for x in y:", sampling=sampling), timeout=120)
    assert next(call).token_ids
    before = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    assert before.num_running == 1
    procs["gateway"].send_signal(signal.SIGKILL)
    procs["gateway"].wait(timeout=30)
    deadline = time.monotonic() + 5
    while True:  # the abort is asynchronous; its fenced blocks return when in-flight steps do
        stats = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            break
        assert time.monotonic() < deadline, f"the dead gateway's request still holds resources: {stats}"
    assert stats.num_aborted == before.num_aborted + 1
