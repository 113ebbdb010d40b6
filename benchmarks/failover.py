"""Time from a worker's death to its requests streaming again, and the gap other streams see.

    PYTHONPATH=. .venv/bin/python benchmarks/failover.py [--rounds 5] [--streams 16] [--workers 2]
        [--worker-args "--num-threads 1"] [--out benchmarks/results/failover.json]

Starts a scheduler, `--workers` workers and a gateway (real processes), runs `--streams`
greedy streams, and SIGKILLs one worker once every stream has a token; a fresh worker
replaces it for the next round. Per stream, the longest pause between two deliveries that
spans the kill; the streams whose pause exceeds 3x their median inter-token time before
the kill are the migrated ones: their pause is "death to streaming again". Prints and
writes p50 / p99 over all rounds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import threading
import time
from pathlib import Path

import grpc

from stepahead.ports import free_port
from testing.processes import spawn, wait_serving
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc


def run_round(stub, streams: int, max_tokens: int, kill) -> list[tuple[float, float]]:
    """(pause spanning the kill, median inter-token time before it) per stream."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    started = [threading.Event() for _ in range(streams)]

    def read(i: int) -> None:
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5 + i, 17, 300, 41 + i]),
                                             sampling=sampling)
        for msg in stub.Generate(req, timeout=600):
            if msg.token_ids:
                arrivals[i].append(time.monotonic())
                started[i].set()
        started[i].set()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(300)
    killed_at = time.monotonic()
    kill()
    for t in threads:
        t.join()
    out = []
    for times in arrivals:
        before = [b - a for a, b in zip(times, times[1:]) if b <= killed_at]
        after = [t for t in times if t > killed_at]
        last_before = max([t for t in times if t <= killed_at], default=killed_at)
        if after:
            out.append((after[0] - last_before, statistics.median(before) if before else 0.0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-args", default="--num-threads 1")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/failover.json"))
    args = parser.parse_args()
    from model_zoo.builtin_models import resolve_model

    model = str(resolve_model(args.model))
    sched_port, gw_port = free_port(), free_port()
    sched = f"127.0.0.1:{sched_port}"
    procs = [spawn("scheduler", "--port", str(sched_port), "--routing-policy", "least_loaded")]
    workers = [spawn("worker", "--scheduler", sched, "--model", model, *shlex.split(args.worker_args))
               for _ in range(args.workers)]
    procs.append(spawn("gateway", "--scheduler", sched, "--port", str(gw_port), "--http-port", "0", "--model", model))
    migrated, others = [], []
    try:
        wait_serving(sched)
        wait_serving(f"127.0.0.1:{gw_port}")
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{gw_port}"))
        for r in range(args.rounds):
            victim = workers.pop(0)

            def kill() -> None:
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                workers.append(spawn("worker", "--scheduler", sched, "--model", model,
                                     *shlex.split(args.worker_args)))

            for pause, itl in run_round(stub, args.streams, args.max_tokens, kill):
                (migrated if pause > 3 * itl else others).append(pause)
            print(f"round {r}: {len(migrated)} migrated pauses so far", flush=True)
    finally:
        for p in procs + workers:
            p.terminate()
        for p in procs + workers:
            p.wait(timeout=30)

    def pct(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))

    result = {
        "workers": args.workers, "streams": args.streams, "rounds": args.rounds, "model": args.model,
        "migrated_streams": len(migrated),
        "death_to_streaming_p50_s": pct(migrated, 50), "death_to_streaming_p99_s": pct(migrated, 99),
        "other_streams_pause_p50_s": pct(others, 50), "other_streams_pause_p99_s": pct(others, 99),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
