"""Many daemons, killed at random: 8 sim workers under 2 schedulers, 4 gateways each using
both schedulers. While requests stream, a worker is SIGKILLed (and a new one started), a
scheduler is SIGKILLed (and restarted on its port: its workers re-attach by themselves),
then a worker again. Every request ends with its full output, exactly the sim worker's
reference tokens (no gap, none twice: the continuation of a resubmitted or migrated request
draws the very same tokens), no block leaks in either scheduler, no orphan process.

The default run is sized for CI (120 requests, 2 sim workers per scheduler, 2 gateways:
the same kills, each scheduler keeps a worker when one dies); `--slow` runs the issue's
size (2,000 requests, 4 workers per scheduler, 4 gateways)."""

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
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from testing.processes import spawn
from tests.service.streams import wait_health

SEED, EOS_P = 5, 0.02
NUM_SCHEDULERS = 2


class SimCluster:
    def __init__(self, model_dir, profile, workers_per_scheduler: int, num_gateways: int) -> None:
        self.model_dir, self.profile = str(model_dir), str(profile)
        self.ports = [free_port() for _ in range(NUM_SCHEDULERS)]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen] = []  # every process ever started
        self.schedulers = [self._start(self.scheduler_args(i)) for i in range(NUM_SCHEDULERS)]
        self.workers = [(i, self.start_worker(i)) for i in range(NUM_SCHEDULERS) for _ in range(workers_per_scheduler)]
        self.gateway_ports = [free_port() for _ in range(num_gateways)]
        flags = [f for a in self.addresses for f in ("--scheduler", a)]
        for port in self.gateway_ports:
            self._start(["gateway", *flags, "--port", str(port), "--http-port", "0", "--model", self.model_dir])

    def scheduler_args(self, i: int) -> list[str]:
        return ["scheduler", "--port", str(self.ports[i]), "--worker-wait-timeout", "120"]

    def _start(self, args: list[str]) -> subprocess.Popen:
        p = spawn(*args, log_level="error")
        self.procs.append(p)
        return p

    def start_worker(self, i: int) -> subprocess.Popen:
        return self._start(["worker", "--scheduler", self.addresses[i], "--model", self.model_dir, "--device", "sim",
                            "--sim-profile", self.profile, "--sim-eos-probability", str(EOS_P), "--seed", str(SEED)])

    def wait_ready(self) -> None:
        for a in [*self.addresses, *(f"127.0.0.1:{p}" for p in self.gateway_ports)]:
            wait_health(a, serving=True)

    def kill_worker(self, rng: random.Random) -> None:
        k = rng.randrange(len(self.workers))
        i, proc = self.workers.pop(k)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        self.workers.append((i, self.start_worker(i)))

    def kill_scheduler(self, i: int) -> None:
        self.schedulers[i].send_signal(signal.SIGKILL)
        self.schedulers[i].wait(timeout=30)
        self.schedulers[i] = self._start(self.scheduler_args(i))

    def stats(self, i: int) -> scheduler_pb2.SchedulerStats:
        with grpc.insecure_channel(self.addresses[i]) as ch:
            return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            p.wait(timeout=30)


def reference_rule(model_dir):
    from worker_service.sim.profiles import load_profile
    from worker_service.sim.runner import SimRunner

    return SimRunner(model_dir, load_profile("h200"), seed=SEED, eos_probability=EOS_P, num_blocks=64)


def check_reference_outputs(runner, work: list, results: list) -> None:
    """Each request's streamed tokens are the sim's reference tokens, and it ended normally."""
    from worker_service.sim.tokens import reference_output

    for i, ((prompt, s), (tokens, reason)) in enumerate(zip(work, results)):
        want = reference_output(runner.rule, prompt, s, runner.max_model_len)
        assert tokens == want, f"request {i}: {len(tokens)} tokens, want {len(want)}; first diff at " \
            f"{next((k for k, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))}"
        assert reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH), (i, reason)


def request(prompt: list[int], s: SamplingParams) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=s.max_tokens, seed=s.seed)
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling)


@pytest.mark.parametrize("num_requests, workers_per_scheduler, num_gateways", [
    (120, 2, 2), pytest.param(2000, 4, 4, marks=pytest.mark.slow),
], ids=["120", "2000"])
def test_killing_workers_and_a_scheduler_loses_no_request(sim_model_dir, fast_profile, num_requests,
                                                          workers_per_scheduler, num_gateways):
    pytest.importorskip("worker_service.sim.tokens")
    runner = reference_rule(sim_model_dir)
    rng = random.Random(num_requests)
    work = []
    for i in range(num_requests):
        prompt = [rng.randrange(5, runner.vocab_size) for _ in range(rng.randint(4, 64))]
        work.append((prompt, SamplingParams(temperature=1.0, max_tokens=rng.randint(8, 48), seed=rng.randrange(1000))))
    cluster = SimCluster(sim_model_dir, fast_profile, workers_per_scheduler, num_gateways)
    try:
        cluster.wait_ready()
        channels = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in cluster.gateway_ports]
        stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in channels]
        done = [0]
        lock = threading.Lock()

        def run(i: int) -> tuple[list[int], int]:
            tokens, last = [], None
            for msg in stubs[i % len(stubs)].Generate(request(*work[i]), timeout=300):
                tokens += msg.token_ids
                last = msg
            with lock:
                done[0] += 1
            return tokens, last.finish_reason

        chaos_done = threading.Event()

        def chaos() -> None:  # at random moments while requests stream
            for action in ("worker", "scheduler", "worker"):
                target = done[0] + rng.randint(num_requests // 8, num_requests // 4)
                while done[0] < min(target, num_requests - 20):
                    chaos_done.wait(0.02)
                if action == "worker":
                    cluster.kill_worker(rng)
                else:
                    cluster.kill_scheduler(rng.randrange(NUM_SCHEDULERS))
            chaos_done.set()

        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(run, range(num_requests)))
        chaos_thread.join(timeout=60)
        assert chaos_done.is_set(), "the chaos did not happen while requests streamed"
        check_reference_outputs(runner, work, results)
        for ch in channels:
            ch.close()
        for i in range(NUM_SCHEDULERS):
            wait_health(cluster.addresses[i], serving=True)
            deadline = time.monotonic() + 10
            while True:  # aborts of cancelled attempts settle with the steps in flight
                stats = cluster.stats(i)
                if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
                    break
                assert time.monotonic() < deadline, f"scheduler {i} leaks: {stats}"
    finally:
        cluster.close()
    assert all(p.poll() is not None for p in cluster.procs), "an orphan process"
