"""Data-parallel scaling under one scheduler: output tok/s with 1, 2, 4, 8 sim replicas.

    PYTHONPATH=. .venv/bin/python benchmarks/replicas.py [--replicas 1 2 4 8] \
        [--streams-per-replica 64] [--output-len 128] [--gateways 2] \
        [--out benchmarks/results/replicas.json]

For each N: one scheduler, N `--device sim --sim-profile h200` workers serving
`llama3-8b-sim` (Llama-3-8B's geometry; the step time is the H200 roofline, no torch),
`--gateways` gateways; `stepahead bench`'s closed-loop client sends N x
`--streams-per-replica` requests at once, spread over the gateways. Reports output tok/s,
scaling efficiency (tok/s / (N x tok/s at 1)), the scheduler process's CPU seconds per
step and its CPU utilisation (1.0 = one core busy: the single scheduler saturates there).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from benchmarks.machine import cpu_seconds
from cli import bench as bench_mod
from stepahead.ports import free_port
from testing.processes import spawn, wait_replicas, wait_serving
from stepahead.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MODEL = "llama3-8b-sim"


def measure(n: int, args, model_dir: str) -> dict:
    sched_port = free_port()
    sched = f"127.0.0.1:{sched_port}"
    scheduler = spawn("scheduler", "--port", str(sched_port), "--routing-policy", "least_loaded",
                      "--max-num-seqs", str(args.streams_per_replica))
    workers = [spawn("worker", "--scheduler", sched, "--model", model_dir, "--device", "sim",
                     "--sim-profile", "h200") for _ in range(n)]
    gw_ports = [free_port() for _ in range(args.gateways)]
    gateways = [spawn("gateway", "--scheduler", sched, "--port", str(p), "--http-port", "0", "--model", model_dir)
                for p in gw_ports]
    try:
        wait_serving(sched)
        for p in gw_ports:
            wait_serving(f"127.0.0.1:{p}")
        with grpc.insecure_channel(sched) as ch:
            sched_stub = scheduler_pb2_grpc.SchedulerStub(ch)
            wait_replicas(sched_stub, n)
            steps0 = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).num_steps
            cpu0, t0 = cpu_seconds(scheduler.pid), time.monotonic()
            per_gateway = n * args.streams_per_replica // args.gateways
            with ThreadPoolExecutor(args.gateways) as pool:
                results = list(pool.map(lambda p: run_bench(p, per_gateway, args), gw_ports))
            elapsed = time.monotonic() - t0
            cpu = cpu_seconds(scheduler.pid) - cpu0
            steps = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).num_steps - steps0
        tokens = sum(r["output_tokens"] for r in results)
        return {"replicas": n, "streams": n * args.streams_per_replica, "output_tokens": tokens,
                "elapsed_s": elapsed, "output_tok_s": tokens / elapsed, "scheduler_steps": steps,
                "scheduler_cpu_s_per_step": cpu / max(steps, 1), "scheduler_cpu_utilisation": cpu / elapsed}
    finally:
        for p in [*gateways, *workers, scheduler]:
            p.terminate()
        for p in [*gateways, *workers, scheduler]:
            p.wait(timeout=30)


def run_bench(port: int, num: int, args) -> dict:
    parser = argparse.ArgumentParser()
    bench_mod.add_arguments(parser)
    ns = parser.parse_args(["--target", f"127.0.0.1:{port}", "--num-prompts", str(num), "--random-input-len",
                            str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
                            "--seed", str(port)])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        workload = bench_mod.make_workload(ns, args.vocab_size)
        results = bench_mod.run_workload(stub, workload, ns)[0]
    return {"output_tokens": sum(r.output_len for r in results), "errors": sum(bool(r.error) for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--streams-per-replica", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/replicas.json"))
    args = parser.parse_args()
    from model_zoo.builtin_models import resolve_model

    model_dir = str(resolve_model(MODEL))
    rows = []
    for n in args.replicas:
        row = measure(n, args, model_dir)
        row["scaling_efficiency"] = row["output_tok_s"] / (n * rows[0]["output_tok_s"] / rows[0]["replicas"]) \
            if rows else 1.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": MODEL, "profile": "h200", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
