"""Disaggregated prefill/decode under chaos: one scheduler, two prefill and two decode sim
workers, a gateway. While requests stream, a prefill worker is SIGKILLed (a new one started
with the same role), then a decode worker, then again each. Every request ends with exactly
the sim worker's reference tokens (no gap, none twice, whichever replica computed which
token and whether its KV was loaded, its load failed, or it was computed again), the
scheduler's blocks all come back, and no process is left behind.

The default run is sized for CI (300 requests); `--slow` runs the issue's 1,000."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from stepahead.plan import SamplingParams
from stepahead.ports import free_port
from stepahead.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from testing.processes import spawn
from tests.service.streams import wait_health
from tests.sim.test_sim_chaos import EOS_P, SEED, check_reference_outputs, reference_rule, request

ROLES = ("prefill", "prefill", "decode", "decode")


class DisaggCluster:
    def __init__(self, model_dir, profile) -> None:
        self.model_dir, self.profile = str(model_dir), str(profile)
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.procs: list[subprocess.Popen] = []  # every process ever started
        self._start(["scheduler", "--port", str(port), "--worker-wait-timeout", "120"])
        self.workers = [(role, self.start_worker(role)) for role in ROLES]
        self.gateway_port = free_port()
        self._start(["gateway", "--scheduler", self.address, "--port", str(self.gateway_port), "--http-port", "0",
                     "--model", self.model_dir])

    def _start(self, args: list[str]) -> subprocess.Popen:
        p = spawn(*args, log_level="error")
        self.procs.append(p)
        return p

    def start_worker(self, role: str) -> subprocess.Popen:
        return self._start(["worker", "--scheduler", self.address, "--model", self.model_dir, "--device", "sim",
                            "--sim-profile", self.profile, "--sim-eos-probability", str(EOS_P), "--seed", str(SEED),
                            "--role", role])

    def kill_worker(self, role: str, rng: random.Random) -> None:
        k = rng.choice([k for k, (r, _) in enumerate(self.workers) if r == role])
        _, proc = self.workers.pop(k)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        self.workers.append((role, self.start_worker(role)))

    def stats(self) -> scheduler_pb2.SchedulerStats:
        with grpc.insecure_channel(self.address) as ch:
            return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            p.wait(timeout=30)


@pytest.mark.parametrize("num_requests", [300, pytest.param(1000, marks=pytest.mark.slow)], ids=["300", "1000"])
def test_killing_prefill_and_decode_workers_loses_no_request(sim_model_dir, fast_profile, num_requests):
    runner = reference_rule(sim_model_dir)
    rng = random.Random(num_requests)
    work = []
    for _ in range(num_requests):
        prompt = [rng.randrange(5, runner.vocab_size) for _ in range(rng.randint(4, 160))]
        work.append((prompt, SamplingParams(temperature=1.0, max_tokens=rng.randint(8, 48), seed=rng.randrange(1000))))
    cluster = DisaggCluster(sim_model_dir, fast_profile)
    try:
        wait_health(cluster.address, serving=True)
        wait_health(f"127.0.0.1:{cluster.gateway_port}", serving=True)
        channel = grpc.insecure_channel(f"127.0.0.1:{cluster.gateway_port}")
        stub = generation_pb2_grpc.GenerationStub(channel)
        done = [0]
        lock = threading.Lock()

        def run(i: int) -> tuple[list[int], int]:
            tokens, last = [], None
            for msg in stub.Generate(request(*work[i]), timeout=300):
                tokens += msg.token_ids
                last = msg
            with lock:
                done[0] += 1
            return tokens, last.finish_reason

        chaos_done = threading.Event()

        def chaos() -> None:  # at random moments while requests stream
            for role in ("prefill", "decode", "prefill", "decode"):
                target = done[0] + rng.randint(num_requests // 10, num_requests // 6)
                while done[0] < min(target, num_requests - 20):
                    chaos_done.wait(0.02)
                cluster.kill_worker(role, rng)
            chaos_done.set()

        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(run, range(num_requests)))
        chaos_thread.join(timeout=60)
        assert chaos_done.is_set(), "the chaos did not happen while requests streamed"
        check_reference_outputs(runner, work, results)
        channel.close()
        deadline = time.monotonic() + 10
        while True:  # steps in flight settle
            stats = cluster.stats()
            if stats.num_running == stats.num_waiting == stats.num_loading == 0 \
                    and stats.num_free_blocks == stats.num_total_blocks:
                break
            assert time.monotonic() < deadline, f"the scheduler leaks: {stats}"
        # while a prefill worker restarts, the decode replicas take new prompts whole: how many
        # requests moved depends on the timing; that some did, and their KV was loaded, does not
        assert stats.num_handoffs > 0 and stats.num_loaded_blocks > 0, stats
    finally:
        cluster.close()
    assert all(p.poll() is not None for p in cluster.procs), "an orphan process"
