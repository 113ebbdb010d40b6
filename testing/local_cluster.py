"""A cluster of separate daemons on 127.0.0.1 (one scheduler, sim workers, gateways), for
soak runs and chaos tests: start, kill and restart members, read their resource usage.

    cluster = LocalCluster(model_dir, profile_json, workers=4, gateways=2)
    cluster.wait_ready(); ...; cluster.kill_and_restart("worker", rng); cluster.close()
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from stepahead import security
from stepahead.ports import free_ports
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc


def process_usage(pid: int) -> dict[str, float]:
    """RSS (MiB), threads and open file descriptors of a live process (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


class LocalCluster:
    def __init__(self, model_dir: Path | str, sim_profile: Path | str, *, workers: int, gateways: int,
                 worker_flags: list[str] = (), gateway_flags: list[str] = (), gateway_env: dict[str, str] | None = None,
                 log_level: str = "error") -> None:
        self.model_dir, self.profile = str(model_dir), str(sim_profile)
        self.token = secrets.token_urlsafe(16)
        self.env = dict(os.environ, STEPAHEAD_LOG_LEVEL=log_level, STEPAHEAD_CLUSTER_TOKEN=self.token)
        sched_port, *gateway_ports = free_ports(1 + gateways)
        self.scheduler_address = f"127.0.0.1:{sched_port}"
        self.gateway_addresses = [f"127.0.0.1:{port}" for port in gateway_ports]
        self.worker_flags, self.gateway_flags = list(worker_flags), list(gateway_flags)
        self.gateway_env = dict(self.env, **(gateway_env or {}))
        self.everything: list[subprocess.Popen] = []  # every process ever started
        self.members: dict[str, subprocess.Popen] = {"scheduler": self._spawn(
            ["scheduler", "--port", self.scheduler_address.rsplit(":", 1)[1]])}
        for i in range(workers):
            self.members[f"worker{i}"] = self._spawn(self._worker_args())
        for i, address in enumerate(self.gateway_addresses):
            self.members[f"gateway{i}"] = self._spawn(self._gateway_args(address), self.gateway_env)

    def _spawn(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "cli", *args], env=env or self.env)
        self.everything.append(proc)
        return proc

    def _worker_args(self) -> list[str]:
        return ["worker", "--scheduler", self.scheduler_address, "--model", self.model_dir, "--device", "sim",
                "--sim-profile", self.profile, *self.worker_flags]

    def _gateway_args(self, address: str) -> list[str]:
        flags = self.gateway_flags if "--http-port" in self.gateway_flags else [*self.gateway_flags, "--http-port", "0"]
        return ["gateway", "--scheduler", self.scheduler_address, "--port", address.rsplit(":", 1)[1],
                "--model", self.model_dir, *flags]

    def channel(self):
        return security.channel(self.scheduler_address, cluster_token=self.token)

    def wait_ready(self, timeout_s: float = 300.0, gateways: bool = True) -> None:
        """Until the scheduler (a worker attached) and, unless told otherwise, every gateway
        report SERVING (a TLS gateway is checked by its caller)."""
        import threading

        from cli.serve import wait_healthy

        deadline = time.monotonic() + timeout_s
        for address in (self.scheduler_address, *(self.gateway_addresses if gateways else ())):
            if not wait_healthy(address, list(self.members.values()), deadline, threading.Event()):
                raise RuntimeError(f"{address} did not become healthy")

    def kill_and_restart(self, kind: str, rng: random.Random) -> str:
        """SIGKILL a random member of `kind` (worker, gateway) and start it again."""
        name = rng.choice([n for n in self.members if n.startswith(kind)])
        proc = self.members[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if kind == "worker":
            self.members[name] = self._spawn(self._worker_args())
        else:
            address = self.gateway_addresses[int(name[len(kind):])]
            self.members[name] = self._spawn(self._gateway_args(address), self.gateway_env)
        return name

    def stats(self) -> scheduler_pb2.SchedulerStats:
        with self.channel() as ch:
            return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def leaked_blocks(self, settle_s: float = 30.0) -> int:
        """Device blocks still used once nothing runs or waits (aborts settle with the steps
        in flight, so this polls up to `settle_s`)."""
        deadline = time.monotonic() + settle_s
        while True:
            s = self.stats()
            idle = s.num_running == s.num_waiting == 0
            if idle and s.num_free_blocks == s.num_total_blocks or time.monotonic() > deadline:
                return s.num_total_blocks - s.num_free_blocks
            time.sleep(0.2)  # poll interval of a settle check, not synchronisation of the system under test

    def usage(self) -> dict[str, dict[str, float]]:
        return {name: process_usage(p.pid) for name, p in self.members.items() if p.poll() is None}

    def orphans(self) -> int:
        return sum(p.poll() is None for p in self.everything)

    def close(self) -> None:
        for p in self.everything:
            if p.poll() is None:
                p.terminate()
        for p in self.everything:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
