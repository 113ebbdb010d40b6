"""Routing policies side by side on one shared-prefix workload: prefix-cache hit rate and TTFT.

    PYTHONPATH=. .venv/bin/python benchmarks/routing.py [--replicas 4] [--groups 16] \
        [--per-group 8] [--prefix-len 1024] [--tail-len 32] [--output-len 16] \
        [--max-concurrency 16] [--out benchmarks/results/routing.json]

For each of cache_aware, least_loaded and round_robin: one scheduler with that
`--routing-policy`, `--replicas` sim workers (`--sim-profile h200`, `llama3-8b-sim`: the
H200 roofline's step times, no torch) and one gateway. The same workload each time:
`--groups` groups of `--per-group` requests, every request of a group sharing a
`--prefix-len`-token prefix plus its own tail, in a shuffled order (seeded), closed loop at
`--max-concurrency`. Reports the prefix hit rate (GetStats: hit tokens / looked-up prompt
tokens, overall and per replica) and the client-side TTFT (`stepahead bench`'s keys).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
from pathlib import Path

import grpc

from cli import bench as bench_mod
from cli.serve import wait_healthy
from stepahead.ports import free_port
from testing.processes import spawn, wait_replicas
from stepahead.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MODEL = "llama3-8b-sim"
POLICIES = ("cache_aware", "least_loaded", "round_robin")


def make_workload(args, vocab: int) -> list[bench_mod.WorkItem]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(5, vocab) for _ in range(args.prefix_len)] for _ in range(args.groups)]
    prompts = [p + [rng.randrange(5, vocab) for _ in range(args.tail_len)]
               for p in prefixes for _ in range(args.per_group)]
    rng.shuffle(prompts)
    return [bench_mod.WorkItem(prompt, args.output_len) for prompt in prompts]


def measure(policy: str, args, model_dir: str) -> dict:
    sched_port, gw_port = free_port(), free_port()
    sched = f"127.0.0.1:{sched_port}"
    scheduler = spawn("scheduler", "--port", str(sched_port), "--routing-policy", policy)
    workers = [spawn("worker", "--scheduler", sched, "--model", model_dir, "--device", "sim", "--sim-profile",
                     "h200") for _ in range(args.replicas)]
    gateway = spawn("gateway", "--scheduler", sched, "--port", str(gw_port), "--http-port", "0", "--model", model_dir)
    procs = [gateway, *workers, scheduler]
    try:
        for address in (sched, f"127.0.0.1:{gw_port}"):
            if not wait_healthy(address, procs, float("inf"), threading.Event()):
                raise RuntimeError(f"{address} did not become healthy")
        with grpc.insecure_channel(sched) as sch, grpc.insecure_channel(f"127.0.0.1:{gw_port}") as gch:
            sched_stub = scheduler_pb2_grpc.SchedulerStub(sch)
            wait_replicas(sched_stub, args.replicas)
            vocab = sched_stub.GetModel(scheduler_pb2.GetModelRequest(), timeout=10).vocab_size
            ns = argparse.Namespace(max_concurrency=args.max_concurrency, disable_tqdm=True, ignore_eos=True,
                                    dataset_name="random")
            results, elapsed = bench_mod.run_workload(generation_pb2_grpc.GenerationStub(gch),
                                                      make_workload(args, vocab), ns)
            stats = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    summary = bench_mod.summarize(results, elapsed)
    keys = ("completed", "failed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "median_e2el_ms")
    return {
        "policy": policy,
        "prefix_hit_rate": stats.prefix_hit_tokens / max(stats.prefix_query_tokens, 1),
        "per_replica_hit_rate": [round(r.stats.prefix_hit_tokens / max(r.stats.prefix_query_tokens, 1), 3)
                                 for r in stats.replicas],
        "per_replica_requests": [r.stats.num_finished for r in stats.replicas],
        **{k: summary[k] for k in keys},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--tail-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/routing.json"))
    args = parser.parse_args()
    from model_zoo.builtin_models import resolve_model

    model_dir = str(resolve_model(MODEL))
    rows = []
    for policy in args.policies:
        rows.append(measure(policy, args, model_dir))
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "policies")}
    args.out.write_text(json.dumps({"model": MODEL, "profile": "h200", **config, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
