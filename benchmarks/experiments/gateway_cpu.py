"""Gateway CPU per streamed token: OpenAI HTTP/SSE vs gRPC, side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/gateway_cpu.py --model tiny \
        --out benchmarks/results/gateway_cpu_tiny.json

Starts `stepahead serve`, then alternates rounds of `--concurrency` streaming requests of
`--max-tokens` tokens each (greedy, EOS ignored) over gRPC and over HTTP (SSE, with
`stream_options.include_usage`). Per round it reads the gateway process's CPU time
(user + system, /proc) before and after, and divides by the tokens streamed. Only the
gateway's CPU is counted, not the client's or the other daemons'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx

from benchmarks.machine import cpu_seconds
from model_zoo.builtin_models import resolve_model
from testing.launcher import ServeProcess
from stepahead.v1 import common_pb2, generation_pb2



def gateway_pid(serve: ServeProcess) -> int:
    for pid in serve.child_pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"gateway" in cmdline:
            return pid
    raise RuntimeError("no gateway process found")


def grpc_one(serve: ServeProcess, prompt: str, max_tokens: int) -> int:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = generation_pb2.GenerateRequest(text=prompt, sampling=sampling)
    return sum(len(m.token_ids) for m in serve.gateway.Generate(request, timeout=600))


def http_one(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> int:
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    body.pop("model")
    usage = 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"usage"' in line:
                usage = json.loads(line[5:])["usage"]["completion_tokens"]
    return usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [f"def function_{i}(x):\n" for i in range(args.concurrency)]
    results: dict[str, list[dict]] = {"grpc": [], "http": []}
    with ServeProcess(resolve_model(args.model), "--max-num-seqs", str(args.concurrency)) as serve, \
            httpx.Client(limits=httpx.Limits(max_connections=args.concurrency)) as client, \
            ThreadPoolExecutor(args.concurrency) as pool:
        pid = gateway_pid(serve)
        runs = {
            "grpc": lambda p: grpc_one(serve, p, args.max_tokens),
            "http": lambda p: http_one(client, serve.http_url, p, args.max_tokens),
        }
        for name, run in runs.items():  # warm-up
            list(pool.map(run, prompts[:4]))
        for _ in range(args.rounds):
            for name, run in runs.items():
                cpu0, t0 = cpu_seconds(pid), time.perf_counter()
                tokens = sum(pool.map(run, prompts))
                cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - t0
                results[name].append({"tokens": tokens, "gateway_cpu_s": cpu, "wall_s": round(wall, 3),
                                      "cpu_us_per_token": round(cpu / tokens * 1e6, 1)})
    summary = {name: statistics.median(r["cpu_us_per_token"] for r in rounds) for name, rounds in results.items()}
    print(f"{args.model}: {args.concurrency} concurrent streams x {args.max_tokens} tokens, {args.rounds} rounds each")
    for name, rounds in results.items():
        print(f"  {name:<5} gateway CPU {summary[name]:7.1f} us/token (median)  rounds: "
              + ", ".join(f"{r['cpu_us_per_token']}" for r in rounds))
    print(f"  http / grpc = {summary['http'] / summary['grpc']:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "median_us_per_token":
                                        summary, "rounds": results}, indent=2))


if __name__ == "__main__":
    main()
