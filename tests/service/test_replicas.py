"""Data-parallel replicas under one scheduler, as an operator runs them: a scheduler, two
torch workers and two gateways as separate processes. Requests spread over both replicas;
a worker killed with SIGKILL mid-stream loses nothing: its requests move to the other
replica as recompute and every stream continues, token for token Hugging Face's, none
twice; the scheduler's metrics count the loss and the migrations; all blocks end free. A
worker that joins takes requests at once; one drained with SIGTERM under load hands its
requests over the same way and exits 0."""

from __future__ import annotations

import signal
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from testing.launcher import DaemonLogs
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.model.oracle import assert_matches_hf
from tests.service.hf_oracle import HFGreedy
from tests.service.streams import greedy, wait_health
from tests.service.test_e2e import random_prompts


# a SIGKILLed or drained worker: the scheduler logs the loss (or a detach) and moves its requests
WORKER_GONE = r'"daemon": "scheduler".*"event": "worker_(lost|detached)"'


class Cluster:
    """Separate daemons; `check_logs()` (after `close()`) fails on any warning or above that
    `self.expected` (regular expressions) does not name."""

    def __init__(self, model_dir, num_workers: int, num_gateways: int, *sched_flags: str) -> None:
        self.model_dir = model_dir
        self.logs = DaemonLogs()
        self.expected: list[str] = []
        spawn = self.logs.spawn
        port, self.metrics_port = free_port(), free_port()
        self.sched = f"127.0.0.1:{port}"
        self.procs = {"scheduler": spawn("scheduler", "--port", str(port), "--metrics-port", str(self.metrics_port),
                                         *sched_flags)}
        for i in range(num_workers):
            self.start_worker(f"worker{i}")
        self.gateways = []
        for i in range(num_gateways):
            gw_port = free_port()
            self.procs[f"gateway{i}"] = spawn("gateway", "--scheduler", self.sched, "--port", str(gw_port),
                                              "--http-port", "0", "--model", str(model_dir))
            self.gateways.append(f"127.0.0.1:{gw_port}")
        self.channels = [grpc.insecure_channel(a) for a in [self.sched, *self.gateways]]
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channels[0])
        self.stubs = [generation_pb2_grpc.GenerationStub(ch) for ch in self.channels[1:]]

    def start_worker(self, name: str) -> None:
        self.procs[name] = self.logs.spawn("worker", "--scheduler", self.sched, "--model", str(self.model_dir),
                                 "--num-threads", "1")

    def wait_ready(self, num_replicas: int) -> None:
        for address in [self.sched, *self.gateways]:
            wait_health(address, serving=True)
        self.wait_metric("stepahead:workers_attached", num_replicas)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                         if line and not line.startswith("#"))}

    def wait_metric(self, name: str, value: float, timeout_s: float = 120.0) -> None:
        """Until the scheduler's metric reaches `value` (each attach is one engine event)."""
        done = threading.Event()
        for _ in range(int(timeout_s / 0.05)):
            if self.metrics().get(name) == value:
                return
            done.wait(0.05)
        raise AssertionError(f"{name} never reached {value}: {self.metrics().get(name)}")

    def stats(self) -> scheduler_pb2.SchedulerStats:
        return self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def close(self) -> None:
        """Gateways first, then the rest, as `serve` stops its daemons (cli/serve.py `shutdown`):
        a scheduler stopped while a gateway's Connect stream is still open aborts that stream
        after its grace period, and grpc logs the abort as a warning."""
        for ch in self.channels:
            ch.close()
        gateways = [p for name, p in self.procs.items() if name.startswith("gateway")]
        rest = [p for name, p in self.procs.items() if not name.startswith("gateway")]
        for group in (gateways, rest):
            for p in group:
                if p.poll() is None:
                    p.terminate()
            for p in group:
                p.wait(timeout=30)

    def check_logs(self) -> None:
        problems = self.logs.problems(self.expected)
        assert not problems, problems


@pytest.fixture
def cluster(tiny_model_dir):  # noqa: F811
    c = Cluster(tiny_model_dir, 2, 2, "--routing-policy", "least_loaded")
    try:
        c.wait_ready(2)
        yield c
    finally:
        c.close()
    c.check_logs()


class Stream:
    """One greedy request read in the background; `started` once its first token arrived."""

    def __init__(self, stub, prompt: list[int], max_tokens: int) -> None:
        self.prompt, self.max_tokens = prompt, max_tokens
        self.tokens: list[int] = []
        self.last = None
        self.started = threading.Event()
        self.call = stub.Generate(greedy(prompt, max_tokens), timeout=300)

    def read(self) -> None:
        try:
            for msg in self.call:
                self.tokens += msg.token_ids
                self.last = msg
                self.started.set()
        finally:
            self.started.set()


def run_streams(cluster: Cluster, prompts, max_tokens: int, during=None) -> list[Stream]:
    streams = [Stream(cluster.stubs[i % len(cluster.stubs)], p, max_tokens) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(s.read) for s in streams]
        if during is not None:
            for s in streams:
                assert s.started.wait(120), "a stream never started"
            during()
        for f in futures:
            f.result(timeout=300)
    return streams


def check_streams(hf: HFGreedy, streams: list[Stream]) -> None:
    for i, s in enumerate(streams):
        assert s.last.finish_reason == common_pb2.FINISH_REASON_LENGTH, (i, s.last)
        assert len(s.tokens) == s.max_tokens, f"stream {i}: {len(s.tokens)} tokens, want {s.max_tokens}"
        want, gaps = hf.generate(s.prompt, s.max_tokens)
        assert_matches_hf(s.tokens, want, gaps, f"stream {i}")


def assert_running_on_both(cluster: Cluster) -> None:
    m = cluster.metrics()
    running = {k: v for k, v in m.items() if k.startswith("stepahead:num_requests_running{")}
    assert len(running) == 2 and all(v > 0 for v in running.values()), f"not spread over both: {running}"


def check_no_leaks(cluster: Cluster) -> None:
    stats = cluster.stats()
    assert stats.num_running == stats.num_waiting == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_fenced_blocks == 0, stats


def test_requests_spread_over_replicas_and_survive_a_killed_worker(cluster, hf, tiny_tokenizer):  # noqa: F811
    prompts = random_prompts(32, 1, 120, len(tiny_tokenizer), seed=21)
    before = cluster.metrics()

    def kill_one_worker() -> None:
        assert_running_on_both(cluster)
        cluster.expected = [WORKER_GONE]
        cluster.procs["worker0"].send_signal(signal.SIGKILL)

    streams = run_streams(cluster, prompts, 32, during=kill_one_worker)
    check_streams(hf, streams)
    after = cluster.metrics()
    # (a SIGKILLed worker's stream may end like a clean detach on the server: counted as
    # migrations either way, as a loss only when the stream broke)
    assert after["stepahead:requests_migrated_total"] >= before.get("stepahead:requests_migrated_total", 0) + 1
    assert after["stepahead:workers_attached"] == 1
    check_no_leaks(cluster)

    cluster.start_worker("worker2")  # a new worker takes requests at once
    cluster.wait_metric("stepahead:workers_attached", 2)
    migrated = cluster.metrics()["stepahead:requests_migrated_total"]

    def drain_worker1() -> None:  # SIGTERM under load: its requests move, none is lost
        assert_running_on_both(cluster)  # worker1 has requests to move
        cluster.procs["worker1"].send_signal(signal.SIGTERM)

    # outputs long enough that worker1's requests are still decoding when its drain begins (at 32
    # tokens the tiny model could finish them all between the streams' first tokens and the signal)
    check_streams(hf, run_streams(cluster, prompts[:8], 160, during=drain_worker1))
    assert cluster.procs["worker1"].wait(timeout=60) == 0
    assert cluster.metrics()["stepahead:requests_migrated_total"] > migrated
    check_no_leaks(cluster)


@pytest.mark.slow
def test_without_any_replica_requests_wait_then_resume_or_end_unavailable(tiny_model_dir, hf):  # noqa: F811
    c = Cluster(tiny_model_dir, 1, 1, "--worker-wait-timeout", "600")
    try:
        c.wait_ready(1)
        prompt = [5, 17, 300, 41]

        def kill_and_replace() -> None:
            c.expected = [WORKER_GONE]
            c.procs["worker0"].send_signal(signal.SIGKILL)
            c.wait_metric("stepahead:workers_attached", 0)
            c.start_worker("worker1")

        check_streams(hf, run_streams(c, [prompt], 64, during=kill_and_replace))
        check_no_leaks(c)
    finally:
        c.close()
    c.check_logs()

    c = Cluster(tiny_model_dir, 1, 1, "--worker-wait-timeout", "0.5")
    try:
        c.wait_ready(1)


        def kill() -> None:
            c.expected = [WORKER_GONE]
            c.procs["worker0"].send_signal(signal.SIGKILL)

        with pytest.raises(grpc.RpcError) as info:
            run_streams(c, [prompt], 2000, during=kill)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "--worker-wait-timeout" in info.value.details()
    finally:
        c.close()
    c.check_logs()
