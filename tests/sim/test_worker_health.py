"""A worker's gRPC health (`--health-port`) through real processes (a sim worker: no torch):
NOT_SERVING while it has no scheduler, SERVING once one accepted it, NOT_SERVING when that
scheduler dies (SIGKILL), SERVING again after it re-attached to a new one, NOT_SERVING as
soon as it is told to stop (draining). `python -m stepahead.healthcheck` agrees."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stepahead.ports import free_port
from testing import processes
from tests.service.streams import wait_health

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def spawn(*args: str, capture: bool = False) -> subprocess.Popen:
    return processes.spawn(*args, log_level="info", text=True,
                           stderr=subprocess.PIPE if capture else subprocess.DEVNULL)


def status(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                     wait_for_ready=True).status


def healthcheck_cli(address: str) -> int:
    return subprocess.run([sys.executable, "-m", "stepahead.healthcheck", address], capture_output=True).returncode


def wait_log(proc: subprocess.Popen, event: str) -> None:
    """Read the worker's JSON log lines until `event` shows up (the rest keep draining)."""
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            if f'"{event}"' in line:
                seen.set()
        seen.set()

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(120) and proc.poll() is None, f"worker never logged {event}"


def test_worker_health_follows_attach_scheduler_loss_and_drain(sim_model_dir, fast_profile):
    sched_port, health_port = free_port(), free_port()
    health = f"127.0.0.1:{health_port}"
    worker = spawn("worker", "--scheduler", f"127.0.0.1:{sched_port}", "--model", str(sim_model_dir),
                   "--device", "sim", "--sim-profile", str(fast_profile), "--health-port", str(health_port),
                   "--reconnect-max-backoff-s", "0.5", capture=True)
    schedulers: list[subprocess.Popen] = []
    try:
        wait_log(worker, "attach_failed")  # the model is loaded, no scheduler yet
        assert status(health) == NOT_SERVING and healthcheck_cli(health) == 1
        schedulers.append(spawn("scheduler", "--port", str(sched_port)))
        wait_health(health, serving=True)
        assert healthcheck_cli(health) == 0
        schedulers[0].send_signal(signal.SIGKILL)
        schedulers[0].wait(30)
        wait_health(health, serving=False)
        schedulers.append(spawn("scheduler", "--port", str(sched_port)))  # the worker re-attaches by itself
        wait_health(health, serving=True)
        with grpc.insecure_channel(health) as ch:
            updates = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            assert next(updates).status == SERVING
            worker.send_signal(signal.SIGTERM)
            assert next(updates).status == NOT_SERVING, "draining reports NOT_SERVING before the worker exits"
            updates.cancel()
        assert worker.wait(30) == 0
    finally:
        for p in [worker, *schedulers]:
            if p.poll() is None:
                p.terminate()
        for p in [worker, *schedulers]:
            p.wait(30)
