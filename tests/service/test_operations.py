"""Operating the system as an operator would: SIGTERM drains, overload and deadlines get a
status a client can act on, metrics on the gateway, quiet JSON logs on a normal shutdown.

Findings covered: SIGTERM on `serve` cut every stream (16/16 FINISH_REASON_ERROR within
0.13 s); a 3,000-stream burst got streams CANCELLED with no status; a normal shutdown
logged `level=error worker_lost`; a garbage-bytes request printed a non-JSON traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc

from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.streams import greedy, wait_active_requests, wait_idle


class Stream:
    """A greedy stream in the background; `started` once its first tokens arrived."""

    def __init__(self, stub, max_tokens: int, prompt=(5, 6, 7)) -> None:
        self.started = threading.Event()
        self.tokens: list[int] = []
        self.text = ""
        self.final = None
        self.error: grpc.RpcError | None = None
        self.call = stub.Generate(greedy(list(prompt), max_tokens), timeout=300)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for msg in self.call:
                self.tokens += msg.token_ids
                self.text += msg.text
                self.final = msg
                self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        self.started.set()


def test_sigterm_drains_open_streams_and_logs_quietly(tiny_model_dir):  # noqa: F811
    serve = Serve(tiny_model_dir, log_level="info", capture_stderr=True)
    undisturbed = []
    for i in range(6):  # each stream's ids and text alone, before the drain
        alone = Stream(serve.gateway, 120, prompt=(5, 6, 7 + i))
        alone.thread.join(120)
        undisturbed.append((alone.tokens, alone.text))
    streams = [Stream(serve.gateway, 120, prompt=(5, 6, 7 + i)) for i in range(6)]
    for s in streams:
        assert s.started.wait(120)
    logged_before = len(serve.stderr_lines)
    serve.proc.send_signal(signal.SIGTERM)
    for s in streams:
        s.thread.join(120)
    assert serve.proc.wait(timeout=120) == 0
    for s, (tokens, text) in zip(streams, undisturbed):
        assert s.error is None, s.error
        assert s.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert s.tokens == tokens and s.text == text  # every message, none merged away or reordered
        assert s.final.usage.completion_tokens == len(s.tokens) == 120
    records = [json.loads(line) for line in serve.stderr_lines if line.strip()]  # JSON only
    loud = [r for r in records[logged_before:] if r["level"] not in ("debug", "info")]
    assert not loud, loud


def test_overload_and_deadlines_get_a_status(tiny_model_dir):  # noqa: F811
    """Past the stream limit both transports refuse at once, and the refusals (a client can send
    them at will) are one warning line per 10 s, not a line each."""
    with Serve(tiny_model_dir, "--max-concurrent-streams", "3", capture_stderr=True) as serve:
        streams = [Stream(serve.gateway, 1500, prompt=(5, 6, 7 + i)) for i in range(3)]
        for s in streams:
            assert s.started.wait(120) and s.error is None
        for _ in range(5):
            try:
                list(serve.gateway.Generate(greedy([9], 2), timeout=30))
                raise AssertionError("a 4th stream was accepted past --max-concurrent-streams 3")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-streams" in exc.details()
            body = json.dumps({"model": "tiny", "prompt": [9], "max_tokens": 2}).encode()
            request = urllib.request.Request(serve.http_url + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=30)
                raise AssertionError("a 4th stream was accepted over HTTP")
            except urllib.error.HTTPError as exc:
                assert exc.code == 429 and exc.headers["retry-after"], exc
        refusals = [line for line in serve.stderr_lines if '"event": "request_refused"' in line]
        assert len(refusals) == 1 and '"limit": 3' in refusals[0], refusals
        for s in streams:
            s.call.cancel()
            s.thread.join(60)
        try:  # a client deadline aborts the request upstream
            list(serve.gateway.Generate(greedy([5, 6], 1500), timeout=1.0))
            raise AssertionError("1500 tokens within a 1 s deadline")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        messages = list(serve.gateway.Generate(greedy([8], 3), timeout=60))  # after the aborts on the same link
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        stats = serve.stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks

        # a completions batch takes a slot per prompt, all or none: 4 prompts past the limit of 3
        # are refused, and the ones started before the refusal give their slots back
        wait_active_requests(serve, 0)
        assert post_completion(serve, {"prompt": [[9]] * 4, "max_tokens": 2}) == 429
        assert post_completion(serve, {"prompt": [[9]] * 3, "max_tokens": 2}) == 200
        wait_idle(serve)


def post_completion(serve, body: dict) -> int:
    request = urllib.request.Request(serve.http_url + "/v1/completions", data=json.dumps({"model": "tiny", **body}).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_gateway_metrics_and_json_logs(tiny_model_dir, serve):  # noqa: F811
    """A gateway of its own on the shared system's scheduler: its own Prometheus metrics, and
    JSON lines only on stderr, even for a request of garbage bytes (grpc's own error goes
    through the JSON logger)."""
    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, STEPAHEAD_CLUSTER_TOKEN=serve.cluster_token, STEPAHEAD_LOG_LEVEL="info")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "cli", "gateway", "--scheduler", serve.scheduler_addr, "--port",
         str(port), "--model", str(tiny_model_dir), "--metrics-port", str(metrics_port), "--http-port", "0"],
        env=env, stderr=subprocess.PIPE, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = generation_pb2_grpc.GenerationStub(channel)
        list(stub.Generate(greedy([5, 6], 5), timeout=60, wait_for_ready=True))
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        aborted = 'stepahead:gateway_sequences_finished_total{reason="abort",transport="grpc"} 1.0'
        call = stub.Generate(greedy([5, 6], 400), timeout=60)
        next(call)  # streaming
        call.cancel()  # the client goes away: its sequence is counted as aborted
        deadline, pause = time.monotonic() + 30, threading.Event()
        while aborted not in (text := urllib.request.urlopen(metrics, timeout=10).read().decode()):
            assert time.monotonic() < deadline, text  # (the count lands once the gateway's loop saw the cancel)
            pause.wait(0.05)
        raw = channel.unary_stream("/stepahead.v1.Generation/Generate")
        try:
            list(raw(b"\xff\xff\xff garbage", timeout=10))
        except grpc.RpcError:
            pass
        text = urllib.request.urlopen(metrics, timeout=10).read().decode()
        assert 'stepahead:gateway_sequences_finished_total{reason="length",transport="grpc"} 1.0' in text
        assert aborted in text
        assert 'stepahead:gateway_generation_tokens_total{transport="grpc"} 5.0' in text
        assert "stepahead:gateway_active_requests 0.0" in text
        assert 'stepahead:gateway_gc_pause_seconds_count{generation="2"}' in text  # the heap freeze's, at least
    finally:
        gateway.send_signal(signal.SIGTERM)
        _, err = gateway.communicate(timeout=60)
    assert gateway.returncode == 0
    lines = [line for line in err.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is JSON
    # the undecodable message: answered by the gateway's guard, logged once as JSON (grpc's
    # own traceback line for it is gone), and nothing else above info up to the shutdown
    assert [r["event"] for r in records].count("grpc_message_undecodable") == 1, records
    shutdown = records[[r.get("event") for r in records].index("gateway_ready") + 1:]
    assert all(r["level"] in ("debug", "info") or r["event"] == "grpc_message_undecodable" for r in shutdown), shutdown
