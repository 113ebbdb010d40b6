"""`stepahead generate` exits non-zero, saying why, when its stream does not end normally
(a gateway played by the test: a real gRPC server on 127.0.0.1)."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc

ENDINGS = {
    "length": ([generation_pb2.GenerateResponse(text="ab", token_ids=[1, 2], finish_reason=common_pb2.FINISH_REASON_LENGTH)], 0, ""),
    "stop": ([generation_pb2.GenerateResponse(text="ab", finish_reason=common_pb2.FINISH_REASON_STOP)], 0, ""),
    "cut short": ([generation_pb2.GenerateResponse(text="ab", token_ids=[1, 2])], 1, "without a final message"),
    "error": ([generation_pb2.GenerateResponse(text="a"), generation_pb2.GenerateResponse(
        finish_reason=common_pb2.FINISH_REASON_ERROR, error="the worker was lost")], 1, "FINISH_REASON_ERROR: the worker was lost"),
    "abort": ([generation_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_ABORT)], 1, "FINISH_REASON_ABORT"),
    "status": (grpc.StatusCode.RESOURCE_EXHAUSTED, 1, "RESOURCE_EXHAUSTED"),
}


class ScriptedGateway(generation_pb2_grpc.GenerationServicer):
    def __init__(self, ending) -> None:
        self.ending = ending

    def Generate(self, request, context):
        if isinstance(self.ending, grpc.StatusCode):
            context.abort(self.ending, "queue full")
        yield from self.ending


@pytest.mark.parametrize("case", sorted(ENDINGS))
def test_exit_status_follows_how_the_stream_ended(case):
    ending, code, message = ENDINGS[case]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(ScriptedGateway(ending), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = subprocess.run([sys.executable, "-m", "cli", "generate", "--target", f"127.0.0.1:{port}", "hi"],
                              capture_output=True, text=True, timeout=60)
    finally:
        server.stop(0)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert message in done.stderr


def test_a_reader_that_leaves_early_ends_generate_quietly():
    """`stepahead generate --json | head -1`: the pipe closes under it (more output than a pipe
    holds is still coming); it exits with SIGPIPE's status, 141, and no traceback."""
    import json

    many = [generation_pb2.GenerateResponse(text="ab", token_ids=[1, 2])] * 2000 + [
        generation_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(ScriptedGateway(many), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", "--json", "--target", f"127.0.0.1:{port}",
                                 "hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(60)
    finally:
        server.stop(0)
    assert json.loads(first)["text"] == "ab"
    assert proc.returncode == 141 and "Traceback" not in err, err


def _cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *argv], capture_output=True, text=True,
                          timeout=kw.pop("timeout", 60), **kw)


def test_version_is_the_installed_distributions():
    from importlib import metadata

    done = _cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"stepahead {metadata.version('stepahead')}"


def test_help_shows_enum_defaults_by_value_and_every_client_default():
    scheduler = _cli("scheduler", "--help")
    assert scheduler.returncode == 0, scheduler.stderr
    flat = " ".join(scheduler.stdout.split())  # argparse wraps lines
    assert "default 'fcfs'" in flat and "SchedulingPolicy." not in flat
    generate = " ".join(_cli("generate", "--help").stdout.split())
    for shown in ("--max-tokens MAX_TOKENS most tokens to generate; the prompt plus these must fit the model's "
                  "context (default: 256)", "(default: 127.0.0.1:50050)", "--top-k TOP_K", "(default: -1)"):
        assert shown in generate, shown
    bench = " ".join(_cli("bench", "--help").stdout.split())
    for shown in ("--num-prompts NUM_PROMPTS requests (a trace: its first N) (default: 64)",
                  "output tokens per random request (default: 64)", "(default: inf)"):
        assert shown in bench, shown


class RecordingGateway(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests = []

    def Generate(self, request, context):
        self.requests.append(request)
        yield generation_pb2.GenerateResponse(text="ab", finish_reason=common_pb2.FINISH_REASON_LENGTH)


def test_generate_sends_the_default_max_tokens_when_none_is_given():
    gateway = RecordingGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = _cli("generate", "--target", f"127.0.0.1:{port}", "hi")
        given = _cli("generate", "--target", f"127.0.0.1:{port}", "--max-tokens", "7", "hi")
    finally:
        server.stop(0)
    assert done.returncode == 0 and given.returncode == 0, (done.stderr, given.stderr)
    assert [r.sampling.HasField("max_tokens") for r in gateway.requests] == [True, True]
    assert [r.sampling.max_tokens for r in gateway.requests] == [256, 7]


def test_bench_prints_a_readable_summary_and_where_the_results_went(openai_serve, tmp_path):
    import json

    path = tmp_path / "run.json"
    done = _cli("bench", "--target", openai_serve.gateway_addr, "--num-prompts", "4", "--random-input-len", "8",
                "--random-output-len", "4", "--disable-tqdm", "--result-filename", str(path), timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = lines.index("============ Serving Benchmark Result ============")
    block = lines[start:]
    rows = {line[:40].strip(): line[40:].strip() for line in block if len(line) > 40 and not line.startswith(("=", "-"))}
    assert rows["Successful requests:"] == "4" and rows["Failed requests:"] == "0"
    assert rows["Total generated tokens:"] == "16"
    for name in ("Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 ITL (ms):",
                 "Output token throughput (tok/s):", "Benchmark duration (s):"):
        whole, _, decimals = rows[name].partition(".")
        assert whole.isdigit() and len(decimals) == 2, (name, rows[name])
    assert f"results (JSON, every request): {path}" in lines
    assert f"plot (token arrivals, TPOT histogram): {path.with_suffix('.png')}" in lines
    assert "{" not in done.stdout  # no JSON dump on the terminal
    saved = json.loads(path.read_text())
    assert saved["completed"] == 4 and len(saved["requests"]) == 4 and "config" in saved
    assert path.with_suffix(".png").stat().st_size > 0


def test_bench_refuses_an_empty_workload_and_names_a_refused_request(openai_serve):
    """`--num-prompts 0` was an IndexError traceback; a request the gateway refuses was listed as
    the RpcError's multi-line repr: now `CODE: details`, exit 1 (a request failed)."""
    empty = _cli("bench", "--target", openai_serve.gateway_addr, "--num-prompts", "0")
    assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr
    assert "--num-prompts: must be >= 1" in empty.stderr.strip().splitlines()[-1]
    refused = _cli("bench", "--target", openai_serve.gateway_addr, "--num-prompts", "2", "--random-input-len",
                   "100000", "--disable-tqdm", timeout=300)
    assert refused.returncode == 1, refused.stderr
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error: ")]
    assert errors and errors[0].startswith("error: INVALID_ARGUMENT: prompt.token_ids: ") and "\n" not in errors[0]


def test_bench_checks_where_its_results_go_before_the_run(tmp_path):
    """A --result-filename that cannot be written was a traceback after the whole run; now one
    line and exit 2 before any call (no gateway is needed to find out)."""
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "r.json"
    done = _cli("bench", "--target", "127.0.0.1:1", "--result-filename", str(bad))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"stepahead bench: error: --result-filename {bad}: File exists"]
