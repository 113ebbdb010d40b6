"""One gateway, two schedulers (one torch worker each): requests spread over both; a
scheduler killed with SIGKILL mid-stream loses nothing: the gateway resubmits its requests
to the other one as prompt + the tokens already streamed, and the client's stream goes on,
token for token Hugging Face's, none twice. The killed scheduler restarts on its port, its
worker re-attaches by itself, and the gateway sends it requests again."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from testing.launcher import DaemonLogs
from stepahead.ports import free_port
from stepahead.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.streams import wait_health
from tests.service.test_replicas import Stream, check_streams

# the killed scheduler: its worker logs its failed session and re-attach attempts, the gateway
# the broken link and each resubmission; any other warning or above fails the test
EXPECTED_LOGS = [r'"daemon": "worker".*"event": "(attach_failed|attach_session_failed)", "level": "warning"',
                 r'"daemon": "gateway".*"event": "(scheduler_link_broken|request_resubmitted)", "level": "warning"']


def start_scheduler(logs: DaemonLogs, port: int):
    return logs.spawn("scheduler", "--port", str(port))


def stats(address: str) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(address) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)


def resubmitted(metrics_port: int) -> dict[str, float]:
    """The gateway's `requests_resubmitted` counter by scheduler."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {sample.labels["scheduler"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "stepahead:gateway_requests_resubmitted_total"}


@pytest.mark.slow  # torch workers; the sim chaos test covers scheduler loss in the default run
def test_a_killed_scheduler_s_requests_continue_on_another(tiny_model_dir, hf):  # noqa: F811
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    gw_port, metrics_port = free_port(), free_port()
    logs = DaemonLogs()
    spawn = logs.spawn
    procs = {f"scheduler{i}": start_scheduler(logs, p) for i, p in enumerate(ports)}
    for i, a in enumerate(addresses):
        procs[f"worker{i}"] = spawn("worker", "--scheduler", a, "--model", str(tiny_model_dir), "--num-threads", "1")
    procs["gateway"] = spawn("gateway", "--scheduler", addresses[0], "--scheduler", addresses[1],
                             "--port", str(gw_port), "--http-port", "0", "--model", str(tiny_model_dir),
                             "--metrics-port", str(metrics_port))
    channel = grpc.insecure_channel(f"127.0.0.1:{gw_port}")
    try:
        for a in [*addresses, f"127.0.0.1:{gw_port}"]:
            wait_health(a, serving=True)
        stub = generation_pb2_grpc.GenerationStub(channel)
        streams = [Stream(stub, [5 + i, 17, 300 + i, 41], 200) for i in range(6)]
        threads = [threading.Thread(target=s.read) for s in streams]
        for t in threads:
            t.start()
        for s in streams:
            assert s.started.wait(120)
        running = [stats(a).num_running for a in addresses]
        assert all(running), f"requests not spread over both schedulers: {running}"
        victim = 0
        procs[f"scheduler{victim}"].send_signal(signal.SIGKILL)
        procs[f"scheduler{victim}"].wait(timeout=30)
        for t in threads:
            t.join(timeout=300)
        check_streams(hf, streams)  # every stream whole and = HF: the killed one's requests resumed
        moved = resubmitted(metrics_port)
        assert set(moved) == {addresses[1]} and 1 <= moved[addresses[1]] <= len(streams), moved

        procs[f"scheduler{victim}"] = start_scheduler(logs, ports[victim])  # back on its port
        wait_health(addresses[victim], serving=True)  # its worker re-attached by itself
        again = [Stream(stub, [9 + i, 8, 7], 8) for i in range(8)]
        for s in again:
            s.read()
        check_streams(hf, again)
        assert stats(addresses[victim]).num_finished > 0, "the gateway never came back to the restarted scheduler"
    finally:
        channel.close()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            p.wait(timeout=30)
    problems = logs.problems(EXPECTED_LOGS)
    assert not problems, problems
