"""Gateway and bench-client CPU per streamed token, the gateway isolated from the scheduler.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/gateway_stream_cpu.py [--transport grpc|http] \
        --streams 256 --input-len 512 --output-len 256 --stream-intervals 1 4 --rounds 3 \
        [--baseline /tmp/old-checkout] [--floor] [--profile] --out benchmarks/results/gateway_cpu_grpc.json

A real `stepahead gateway` against `replay_scheduler.py` (the real `Scheduler.Connect`
protocol, encoded by the scheduler's own writer: one token per open request every
`--step-ms`, the shape of the sim worker's h200 + Llama-3-8B decode steps at 256 streams) and a real
`stepahead bench` client (its grpc.aio workload code, in a child process). Per round:
`--streams` requests at once, each of `--input-len` random prompt ids and `--output-len`
tokens. Reported per round: the gateway process's CPU (/proc, user + system) and the client
process's CPU (getrusage), each divided by the tokens the client received, and the tokens
per streamed message (above 1 at stream interval 1 when the gateway fell behind the steps
and merged queued tokens: fewer messages, less CPU per token; compare rows at the same
tokens/message). The replay scheduler's CPU is not counted.

`--transport http` streams over the gateway's OpenAI API instead (`POST /v1/completions`
with `stream` and `include_usage`, token-id prompts): a plain asyncio HTTP/1.1 client reads
each response raw and counts its chunks once at the end, so its own cost per message is a
socket read.

`--api-key KEY` starts the gateways with that key and has the client send it (the check every
request of a server with API keys goes through). `--chat` streams `/v1/chat/completions` over
HTTP (a user message of about `--input-len` tokens through the model's chat template).

`--gateways N` runs N gateways against the one replay scheduler (each its own `Connect`
stream), the client's streams spread over them: their CPU summed per token is the same as one
gateway's when the per-token cost does not depend on how many gateways share the streams (the
design's answer to the per-message floor is more gateways).

`--baseline DIR` runs a second gateway and client from another checkout (e.g. `git archive`
of the commit before a change), with a replay scheduler of that checkout (its wire format),
rounds alternating, so before and after are measured side by side under the same machine
load. `--floor` adds the transport's own cost: a server that streams one prebuilt response per
stream per step (no gateway code) to the same client (`grpc_floor.py`: grpc.aio;
`http_floor.py`: a bare ASGI app on uvicorn, and over HTTP also the same stream through
FastAPI and the gateway's SSE response, the `framework floor`). `--profile` records the gateway with
py-spy during its last round (the thread holding the GIL only: time in C code that releases it,
such as grpc's and the sockets', is left out) and reports the largest leaf frames (µs per
token: sample share × the measured CPU; read it as a ranking, not an exact split).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import cpu_seconds, python_thread_names, thread_cpu_seconds
from model_zoo.builtin_models import resolve_model

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def thread_cpu(pid: int, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) per thread of process `pid`: Python threads by their name,
    the others (grpc core's) by their OS name, threads of one name summed."""
    out: dict[str, float] = collections.defaultdict(float)
    for tid, (comm, seconds) in thread_cpu_seconds(pid).items():
        out[names.get(tid, f"{comm} (not Python)")] += seconds
    return out


def start(argv: list[str], tree: Path) -> subprocess.Popen:
    """A daemon of checkout `tree`; its stderr goes to a temporary file that `wait_ready` shows
    should the daemon exit before it serves."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    stderr = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                            cwd=tree)  # `-m cli` imports from the working directory first
    proc.stderr_file = stderr
    return proc


def check_running(proc: subprocess.Popen) -> None:
    """SystemExit naming the daemon and its last words when `proc` has exited."""
    if proc.poll() is None:
        return
    proc.stderr_file.seek(0)
    tail = proc.stderr_file.read().decode(errors="replace").strip().splitlines()[-3:]
    raise SystemExit(f"{' '.join(map(str, proc.args[1:4]))} exited with {proc.returncode}: " + " | ".join(tail))


def wait_ready(target: str, transport: str, proc: subprocess.Popen, api_key: str | None = None,
               timeout_s: float = 120.0) -> None:
    check = lambda: check_running(proc)  # noqa: E731
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    if transport == "http":
        return wait_http(target, timeout_s, check, dict(metadata or ()))
    import grpc

    from stepahead.v1 import generation_pb2, generation_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while True:
            try:
                stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=2, wait_for_ready=True,
                                  metadata=metadata)
                return
            except grpc.RpcError:
                check()
                if time.monotonic() > deadline:
                    raise


def wait_http(target: str, timeout_s: float, check, headers: dict[str, str]) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            request = urllib.request.Request(f"http://{target}/v1/models", headers=headers)
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            check()
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


async def http_stream(host: str, port: int, body: bytes, auth: bytes = b"", path: bytes = b"/v1/completions"
                      ) -> tuple[int, int]:
    """One streamed completion over a plain HTTP/1.1 connection: (completion tokens from the
    usage chunk, token messages). The response is read raw and parsed once at its end, so the
    client's cost per message is a socket read."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n" + auth
                     + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace").splitlines()[0])
        data = bytearray()
        while not data.endswith(b"data: [DONE]\r\n\r\n\r\n0\r\n\r\n") and not data.endswith(b"\r\n0\r\n\r\n"):
            more = await reader.read(1 << 16)
            if not more:
                break
            data += more
    finally:
        writer.close()
    usage = re.findall(rb'"completion_tokens":\s*(\d+)', data)
    if not usage:
        raise RuntimeError("no usage chunk in the stream")
    messages = data.count(b"data: ") - 2  # neither the usage chunk nor [DONE]
    return int(usage[-1]), messages


def http_client_round(target: str, streams: int, input_len: int, output_len: int, api_key: str | None = None,
                      chat: bool = False) -> dict:
    """`streams` streamed completions at once over HTTP (token-id prompts, EOS ignored, usage asked for)."""
    import random

    addresses = [address.rsplit(":", 1) for address in target.split(",")]  # streams spread over them
    rng = random.Random(0)
    def prompt() -> dict:
        if chat:  # about input_len tokens of words in one user message, through the model's chat template
            words = " ".join(f"w{rng.randrange(1000, 30000)}" for _ in range(input_len // 3))
            return {"messages": [{"role": "user", "content": words}]}
        return {"prompt": [rng.randrange(1000, 30000) for _ in range(input_len)]}

    bodies = [json.dumps({"model": "llama3-8b-sim", **prompt(), "max_tokens": output_len, "ignore_eos": True,
                          "stream": True, "stream_options": {"include_usage": True}}).encode()
              for _ in range(streams)]
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    auth = b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b""

    async def run() -> tuple[list, float]:
        start = time.perf_counter()
        out = await asyncio.gather(*(http_stream(addresses[i % len(addresses)][0], int(addresses[i % len(addresses)][1]),
                                                 b, auth, path) for i, b in enumerate(bodies)), return_exceptions=True)
        return out, time.perf_counter() - start

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    results, elapsed = asyncio.run(run())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in results if not isinstance(r, BaseException)]
    return {"tokens": sum(t for t, _ in ok), "failed": len(results) - len(ok), "messages": sum(m for _, m in ok),
            "wall_s": elapsed, "client_cpu_s": usage.ru_utime + usage.ru_stime - cpu0}


def client_round(target: str, streams: int, input_len: int, output_len: int, api_key: str | None = None) -> dict:
    """One round of the `stepahead bench` client's grpc.aio workload (run in a child process)."""
    from cli import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    wargs = parser.parse_args(["--num-prompts", str(streams), "--max-concurrency", str(streams),
                               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                               "--ignore-eos", "--disable-tqdm"])
    workload = bench.make_workload(wargs, 1000)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = usage.ru_utime + usage.ru_stime
    results, elapsed, _ = asyncio.run(bench.run_workload_async(target, api_key, workload, wargs))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"tokens": sum(r.output_len for r in results if not r.error), "failed": sum(1 for r in results if r.error),
            "messages": sum(len(r.token_times) for r in results if not r.error),
            "wall_s": elapsed, "client_cpu_s": usage.ru_utime + usage.ru_stime - cpu0}


def threads_cpu(pids: list[int], names: list[dict[int, str]]) -> dict[str, float]:
    """`thread_cpu` summed over the processes, by thread name."""
    out: dict[str, float] = collections.defaultdict(float)
    for pid, pid_names in zip(pids, names):
        for name, seconds in thread_cpu(pid, pid_names).items():
            out[name] += seconds
    return out


def one_round(target: str, pids: list[int], tree: Path, args, streams: int, output_len: int,
              spy_out: Path | None) -> dict:
    """One round against the server processes `pids` (their CPU summed; py-spy on the first)."""
    spy = None
    if spy_out is not None:
        spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "-r", "200", "-f", "raw",
                                "--gil", "--nonblocking", "-o", str(spy_out), "-p", str(pids[0])], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
    names = [python_thread_names(pid) for pid in pids]
    gw0, threads0 = sum(cpu_seconds(pid) for pid in pids), threads_cpu(pids, names)
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--client-round", target, "--streams",
                          str(streams), "--input-len", str(args.input_len), "--output-len", str(output_len),
                          "--transport", args.transport, *(["--api-key", args.api_key] if args.api_key else []),
                          *(["--chat"] if args.chat else [])],
                         env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=True)
    gw, threads = sum(cpu_seconds(pid) for pid in pids) - gw0, threads_cpu(pids, names)
    if spy is not None:
        spy.send_signal(2)  # SIGINT: py-spy writes its samples and exits
        spy.wait(60)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    tokens = max(r["tokens"], 1)
    return {"tokens": r["tokens"], "failed": r["failed"], "wall_s": round(r["wall_s"], 3),
            "output_tok_s": round(r["tokens"] / r["wall_s"]), "tokens_per_message": round(tokens / max(r["messages"], 1), 3),
            "gateway_cpu_s": round(gw, 3),
            "client_cpu_s": round(r["client_cpu_s"], 3), "gateway_us_per_token": round(gw / tokens * 1e6, 1),
            "client_us_per_token": round(r["client_cpu_s"] / tokens * 1e6, 1),
            "gateway_threads_us_per_token": {name: round((t - threads0.get(name, 0.0)) / tokens * 1e6, 1)
                                             for name, t in sorted(threads.items(), key=lambda kv: -kv[1])
                                             if t - threads0.get(name, 0.0) > 0}}


def top_frames(path: Path, us_per_token: float, n: int = 15) -> dict[str, float]:
    """Leaf frames of py-spy's (non-idle) samples, in µs per token."""
    counts: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        counts[stack.split(";")[-1]] += int(k)
    total = sum(counts.values()) or 1
    return {k: round(v / total * us_per_token, 1) for k, v in counts.most_common(n)}


class Server:
    """The gateways (or the grpc.aio / uvicorn floor server) of one checkout, started once per
    stream interval: one process per `(argv, port)`, `port` the one the client streams from
    (the gateway's gRPC or HTTP); the client spreads its streams over them."""

    def __init__(self, name: str, tree: Path, launches: list[tuple[list[str], int]]) -> None:
        self.name, self.tree = name, tree
        self.target = ",".join(f"127.0.0.1:{port}" for _, port in launches)
        self.procs = [start(argv, tree) for argv, _ in launches]
        self.pids = [proc.pid for proc in self.procs]

    def close(self) -> None:
        """Every process ends, also one that does not stop on SIGTERM within 30 s (killed): one
        left running would share the next run's port."""
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def trees_of(args) -> list[tuple[str, Path]]:
    return [("after", REPO)] + ([("before", args.baseline.resolve())] if args.baseline else [])


def replay_port(args, i: int) -> int:
    """The port of tree i's replay scheduler."""
    return args.port + 1 + 4 * i


def servers_for(args, interval: int) -> list[Server]:
    out = []
    http = args.transport == "http"
    for i, (name, tree) in enumerate(trees_of(args)):
        sched_addr = f"127.0.0.1:{replay_port(args, i)}"
        launches = []
        for j in range(args.gateways):
            port = args.port + 10 + 20 * i + 2 * j  # and its HTTP port, port + 1
            launches.append((["-m", "cli", "gateway", "--scheduler", sched_addr, "--port", str(port),
                              "--http-port", str(port + 1 if http else 0), "--model", args.model,
                              "--stream-interval", str(interval), "--max-concurrent-streams",
                              str(max(args.streams, 16)), "--log-level", "warning",
                              *(["--api-key", args.api_key] if args.api_key else [])], port + 1 if http else port))
        out.append(Server(name, tree, launches))
    if args.floor and interval == 1:
        port = args.port + 9
        name, script = ("uvicorn floor", "http_floor.py") if http else ("grpc.aio floor", "grpc_floor.py")
        out.append(Server(name, REPO, [([str(HERE / script), "--port", str(port), "--step-ms", str(args.step_ms)],
                                        port)]))
        if http:  # the same stream through FastAPI and the gateway's SSE response
            out.append(Server("framework floor", REPO, [([str(HERE / script), "--port", str(port - 1), "--step-ms",
                                                          str(args.step_ms), "--framework"], port - 1)]))
    return out


def run_interval(args, interval: int) -> list[dict]:
    servers = servers_for(args, interval)
    rows = {s.name: [] for s in servers}
    try:
        for s in servers:
            for target, proc in zip(s.target.split(","), s.procs):
                wait_ready(target, args.transport, proc, args.api_key)
            one_round(s.target, s.pids, s.tree, args, 16, 8, None)  # warm-up
        for r in range(args.rounds):
            for s in servers:  # alternating: the same machine load for each
                spy_out = args.out.parent / f"gateway_cpu_profile_{s.name}_si{interval}.txt" if (
                    args.profile and args.out and r == args.rounds - 1 and not s.name.endswith(" floor")) else None
                rows[s.name].append(one_round(s.target, s.pids, s.tree, args, args.streams, args.output_len,
                                              spy_out))
                print(f"  {s.name} stream interval {interval} round {r}: {rows[s.name][-1]}", flush=True)
    finally:
        for s in servers:
            s.close()
    out = []
    for name, rounds in rows.items():
        row = {"code": name, "stream_interval": interval, "rounds": rounds,
               "gateway_us_per_token": statistics.median(x["gateway_us_per_token"] for x in rounds),
               "client_us_per_token": statistics.median(x["client_us_per_token"] for x in rounds),
               "output_tok_s": statistics.median(x["output_tok_s"] for x in rounds),
               "tokens_per_message": statistics.median(x["tokens_per_message"] for x in rounds)}
        profile = args.out.parent / f"gateway_cpu_profile_{name}_si{interval}.txt" if args.out else None
        if args.profile and profile and profile.exists():
            row["gateway_top_leaf_us_per_token"] = top_frames(profile, rounds[-1]["gateway_us_per_token"])
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b-sim", help="model directory or built-in (its tokenizer)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=22.0, help="the replay scheduler's step time")
    parser.add_argument("--stream-intervals", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=50060, help="first of the ports this uses (10 of them)")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout to measure side by side")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateways per checkout, against its one replay scheduler; the client spreads the "
                             "streams over them and their CPU is summed")
    parser.add_argument("--transport", choices=["grpc", "http"], default="grpc",
                        help="stream over the gateway's gRPC API or its OpenAI HTTP API (SSE)")
    parser.add_argument("--floor", action="store_true",
                        help="also measure the transport's own per-message cost (grpc.aio's, or uvicorn's)")
    parser.add_argument("--profile", action="store_true", help="py-spy each gateway in its last round")
    parser.add_argument("--api-key", default=None, help="start the gateways with this API key; the client sends it")
    parser.add_argument("--chat", action="store_true", help="over HTTP: stream /v1/chat/completions (a user message "
                        "through the model's chat template) instead of /v1/completions")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--client-round", default=None, help=argparse.SUPPRESS)  # the child process's mode
    args = parser.parse_args()
    if args.client_round:
        if args.transport == "http":
            result = http_client_round(args.client_round, args.streams, args.input_len, args.output_len, args.api_key,
                                       args.chat)
        else:
            result = client_round(args.client_round, args.streams, args.input_len, args.output_len, args.api_key)
        print(json.dumps(result))
        return
    args.model = str(resolve_model(args.model))  # a built-in is built once, here (the gateways only read it)
    replays = [start([str(tree / "benchmarks" / "experiments" / "replay_scheduler.py"), "--model", args.model, "--port",
                      str(replay_port(args, i)), "--step-ms", str(args.step_ms)], tree)
               for i, (_, tree) in enumerate(trees_of(args))]  # each checkout's own wire format
    try:
        rows = [row for interval in args.stream_intervals for row in run_interval(args, interval)]
    finally:
        for replay in replays:
            replay.terminate()
            replay.wait(30)
    print(f"{args.transport}: {args.streams} streams x {args.output_len} tokens, {args.step_ms} ms steps, "
          f"load {os.getloadavg()[0]:.2f}, medians of {args.rounds} rounds")
    for row in rows:
        print(f"  {row['code']:<15} stream interval {row['stream_interval']}: gateway {row['gateway_us_per_token']:6.1f}"
              f" us/token, client {row['client_us_per_token']:6.1f} us/token, {row['output_tok_s']} tok/s, "
              f"{row['tokens_per_message']:.2f} tokens/message")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": rows,
                                        "load_average": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
