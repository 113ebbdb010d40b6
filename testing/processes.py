"""Daemons as subprocesses for tests and benchmarks: start one, wait until it serves, wait
until a scheduler holds n replicas."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stepahead.v1 import scheduler_pb2


def spawn(*args: str, log_level: str = "warning", env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`stepahead ARGS...` with this interpreter at STEPAHEAD_LOG_LEVEL `log_level`, `env`
    added to this process's environment; `popen` goes to `subprocess.Popen` (e.g.
    stderr=subprocess.PIPE, text=True)."""
    env = dict(os.environ, STEPAHEAD_LOG_LEVEL=log_level, **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "cli", *args], env=env, **popen)


def spawn_gateway(scheduler: str, model_dir: str, cluster_token: str | None, *flags: str,
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """One more gateway (gRPC only) on a free loopback port for the scheduler at `scheduler`,
    waited for until it serves: (process, its address)."""
    from stepahead.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    token = {"STEPAHEAD_CLUSTER_TOKEN": cluster_token} if cluster_token else {}
    proc = spawn("gateway", "--scheduler", scheduler, "--port", address.rsplit(":", 1)[1], "--http-port", "0",
                 "--model", model_dir, *flags, env={**token, **(env or {})})
    try:
        wait_serving(address)
    except BaseException:
        proc.terminate()
        proc.wait(30)
        raise
    return proc, address


def wait_serving(address: str, timeout_s: float = 300.0) -> None:
    """Until gRPC health at `address` says SERVING (the Watch stream, no polling)."""
    with grpc.insecure_channel(address) as ch:
        for update in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=timeout_s,
                                                            wait_for_ready=True):
            if update.status == health_pb2.HealthCheckResponse.SERVING:
                return


def attached_replicas(stub) -> list[str]:
    """The replicas a scheduler holds now (its flight record names them)."""
    record = stub.GetFlightRecord(scheduler_pb2.GetFlightRecordRequest(), timeout=10)
    return [w for w in record.worker_id.split(",") if w]


def wait_replicas(stub, n: int, timeout_s: float = 300.0) -> None:
    """Until the scheduler behind `stub` holds at least `n` replicas."""
    deadline = time.monotonic() + timeout_s
    while len(attached_replicas(stub)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} replicas never attached")
        time.sleep(0.05)
