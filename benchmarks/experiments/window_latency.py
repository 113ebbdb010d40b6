"""What a deeper in-flight window costs at moderate load: TTFT / TPOT per `--max-concurrent-batches`.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/window_latency.py --windows 2 3 auto --rounds 2 \
        --out benchmarks/results/window_latency.json

The cross-check's trace (`crosscheck.py`: Poisson, 6 requests/s, prompts 64–1024, outputs
16–256, a third in prefix groups; written here with the same seed) replayed in real time
against `stepahead serve --device sim` (h200 + llama3-8b-sim) once per window, alternating.
A plan made W-1 steps ahead means a request that arrives now is planned after the W-1 steps
already in flight: about one decode step more time to first token per extra plan. `auto`
(the default) plans the third only while the device waits for plans. Also reported: the
share of steps the scheduler counted late (`stepahead:late_plans_total` / steps).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.experiments.critical_chain import late_fraction, window_flags
from benchmarks.crosscheck import write_trace
from benchmarks.machine import python_speed_ms
from cli import bench
from testing.launcher import ServeProcess
from stepahead.ports import free_port

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput", "device_utilization")


def run(window: str, trace: Path, num_requests: int) -> dict:
    speed = python_speed_ms()
    port = free_port()
    with ServeProcess("llama3-8b-sim", "--device", "sim", "--sim-profile", "h200", *window_flags(window),
                      "--metrics-port", str(port)) as serve:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        ns = parser.parse_args(["--target", serve.gateway_addr, "--scheduler", serve.scheduler_addr,
                                f"--cluster-token={serve.cluster_token}", "--dataset-name", "trace",
                                "--dataset-path", str(trace), "--disable-tqdm", "--num-prompts", str(num_requests)])
        summary = bench.bench(ns)
        late = late_fraction(port)
    return {"window": window, **{k: summary.get(k) for k in KEYS}, "late_steps": late, "python_speed_ms": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", nargs="+", default=["2", "3", "auto"], choices=["1", "2", "3", "4", "auto"],
                        help="fixed windows and/or auto (the default adaptive window, up to 3)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/window_latency.json"))
    args = parser.parse_args()
    trace = args.out.with_suffix(".trace.jsonl")
    write_trace(trace, args.num_requests, args.rate, seed=0)
    rows = []
    for _ in range(args.rounds):
        for window in args.windows:
            row = run(window, trace, args.num_requests)
            rows.append(row)
            print(f"window {window}: TTFT p50 {row['median_ttft_ms']:.1f} p99 {row['p99_ttft_ms']:.1f} ms, TPOT p50 "
                  f"{row['median_tpot_ms']:.2f} p99 {row['p99_tpot_ms']:.2f} ms, util "
                  f"{row['device_utilization']:.1%}, late steps {row['late_steps']:.1%}, py ms "
                  f"{row['python_speed_ms']:.0f}", flush=True)
    args.out.write_text(json.dumps({"rate": args.rate, "num_requests": args.num_requests, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
