"""SIGTERM on `serve` drains: every open stream, gRPC and HTTP (SSE), gets exactly the token
ids and text it would have got undisturbed, in order, with its final usage equal to what it
delivered; under CPU load (a busy loop on each core), a few rounds.

Finding covered: streams drained by SIGTERM ended normally (LENGTH, usage 200) while some
clients had received fewer ids, text missing in the middle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import openai
import pytest

from stepahead import security
from stepahead.v1 import common_pb2, generation_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.streams import greedy

MAX_TOKENS = 200
STREAMS_PER_TRANSPORT = 4
BUSY_S = 120  # the load's own bound: it ends even if the test is killed


def _grpc_stream(stub, prompt, started: threading.Event, out: dict) -> None:
    ids, text, final = [], [], None
    try:
        for msg in stub.Generate(greedy(list(prompt), MAX_TOKENS), timeout=300):
            ids += msg.token_ids
            text.append(msg.text)
            if msg.finish_reason:
                final = msg
            started.set()
    except grpc.RpcError as exc:
        out["error"] = exc
    out.update(ids=ids, text="".join(text), final=final)
    started.set()


def _http_stream(client: openai.OpenAI, prompt, started: threading.Event, out: dict) -> None:
    tokens, text, usage, reasons = [], [], None, []
    try:
        for chunk in client.completions.create(model="tiny", prompt=list(prompt), max_tokens=MAX_TOKENS,
                                               temperature=0.0, logprobs=0, stream=True,
                                               stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text.append(c.text)
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                if c.finish_reason:
                    reasons.append(c.finish_reason)
            started.set()
    except openai.OpenAIError as exc:
        out["error"] = exc
    out.update(tokens=tokens, text="".join(text), usage=usage, reasons=reasons)
    started.set()


def _busy_loops() -> list[subprocess.Popen]:
    code = f"import time\nend = time.monotonic() + {BUSY_S}\nwhile time.monotonic() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 1)]


def _run(target, *args) -> tuple[threading.Event, dict, threading.Thread]:
    started, out = threading.Event(), {}
    thread = threading.Thread(target=target, args=(*args, started, out), daemon=True)
    thread.start()
    return started, out, thread


@pytest.mark.parametrize("round_", range(3))
def test_sigterm_delivers_every_open_stream_whole_on_both_transports(tiny_model_dir, round_):  # noqa: F811
    serve = Serve(tiny_model_dir, "--max-num-seqs", "16", log_level="info", capture_stderr=True)
    channel = security.channel(serve.gateway_addr)  # as `stepahead generate` connects
    client = openai.OpenAI(base_url=serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    busy: list[subprocess.Popen] = []
    try:
        stub = generation_pb2_grpc.GenerationStub(channel)
        prompts = [(5, 6, 7 + i + 10 * round_) for i in range(STREAMS_PER_TRANSPORT)]
        want_grpc, want_http = [], []
        for prompt in prompts:  # each one's undisturbed output, alone
            _, out, thread = _run(_grpc_stream, stub, prompt)
            thread.join(300)
            want_grpc.append(out)
            _, out, thread = _run(_http_stream, client, prompt)
            thread.join(300)
            want_http.append(out)
        for w in want_grpc:
            assert "error" not in w and len(w["ids"]) == MAX_TOKENS, w
        for w in want_http:
            assert "error" not in w and len(w["tokens"]) == MAX_TOKENS, w
        busy = _busy_loops()
        runs = [("grpc", i, *_run(_grpc_stream, stub, p)) for i, p in enumerate(prompts)]
        runs += [("http", i, *_run(_http_stream, client, p)) for i, p in enumerate(prompts)]
        for _, _, started, _, _ in runs:
            assert started.wait(120), "a stream never got its first message"
        serve.proc.send_signal(signal.SIGTERM)
        for _, _, _, _, thread in runs:
            thread.join(300)
        assert serve.proc.wait(timeout=120) == 0
        for transport, i, _, got, _ in runs:
            assert "error" not in got, (transport, i, got["error"])
            if transport == "grpc":
                assert got["ids"] == want_grpc[i]["ids"], (i, len(got["ids"]))
                assert got["text"] == want_grpc[i]["text"]
                assert got["final"].finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert got["final"].usage.completion_tokens == len(got["ids"])
            else:
                assert got["tokens"] == want_http[i]["tokens"], (i, len(got["tokens"]))
                assert got["text"] == want_http[i]["text"] == want_grpc[i]["text"]
                assert got["reasons"] == ["length"] and got["usage"].completion_tokens == len(got["tokens"])
        records = [json.loads(line) for line in serve.stderr_lines if line.strip().startswith("{")]
        assert not [r for r in records if r.get("event") == "stream_usage_mismatch"]
        assert any(r.get("event") == "gateway_drained" for r in records)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        client.close()
        channel.close()
        serve.close()


def test_a_stopping_scheduler_ends_the_streams_its_peers_keep_open():
    """SIGTERM on a scheduler with a gateway's Connect stream still open after the grace period:
    the scheduler ends the stream itself, so the gateway reads a normal end (and goes elsewhere)
    and nothing is logged above info. grpc's server stop aborted it: the gateway got an error
    status and the scheduler logged "Aborting method ... due to server stop." at warning on a
    normal shutdown (found as a flaky teardown of `test_recovery.py`)."""
    from stepahead.ports import free_port
    from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc
    from testing.launcher import DaemonLogs

    logs = DaemonLogs(log_level="info")
    port = free_port()
    sched = logs.spawn("scheduler", "--port", str(port))
    keep_open = threading.Event()

    def messages():  # a gateway whose one request is refused (no worker), and that never closes its side
        yield scheduler_pb2.GatewayMessage(submit=scheduler_pb2.SubmitRequest(request_id="r"))
        keep_open.wait(120)

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)  # listening (it serves once a worker attaches)
            call = scheduler_pb2_grpc.SchedulerStub(channel).Connect(messages())
            refused = next(call)  # the stream is open on the scheduler's side: its refusal came back
            assert [e.rejected for e in refused.events] == [True], refused
            sched.send_signal(signal.SIGTERM)
            rest = list(call)  # raises if the call was aborted
            assert rest == [] and call.code() == grpc.StatusCode.OK, call.code()
            assert sched.wait(timeout=60) == 0
    finally:
        keep_open.set()
        if sched.poll() is None:
            sched.kill()
    assert not logs.problems(), logs.problems()
    assert any('"streams_ended_at_shutdown"' in line for line in logs.lines), logs.lines[-5:]
