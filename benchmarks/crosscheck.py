"""Offline prediction vs the real-time sim-worker system on the same trace and profile.

    PYTHONPATH=. .venv/bin/python benchmarks/crosscheck.py --sim-profile h200 --rate 6 \
        --num-requests 200 --out benchmarks/results/crosscheck.json

Writes a Poisson trace (moderate load), runs `stepahead simulate` on it twice (the scheduler
core on a virtual clock: once with a free control plane, once with the daemons' latencies that
`benchmarks/hops.py` measures first, on lone requests, in this same invocation), then
`stepahead serve --device sim` + `stepahead bench --dataset-name trace` on the same file, and
prints TTFT / TPOT / ITL of all three. The free prediction's gap is what the control plane
(planning, gRPC, streaming, the client) costs. Goal: TTFT and TPOT p50 within 15 %.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from scheduler_service.server import SchedulerDaemonConfig
from cli import bench, simulate
from stepahead import config as cfg
from testing.launcher import ServeProcess
from benchmarks import hops

KEYS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_ttft_ms", "p99_tpot_ms", "output_throughput")


def write_trace(path: Path, n: int, rate: float, seed: int) -> None:
    rng = random.Random(seed)
    t, rows = 0.0, []
    for i in range(n):
        rows.append({"arrival_s": t, "prompt_len": rng.randint(64, 1024), "output_len": rng.randint(16, 256),
                     **({"prefix_group": f"g{i % 4}"} if i % 3 == 0 else {})})
        t += rng.expovariate(rate)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def offline(args, trace: Path, latencies_ms: dict[str, float] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    ns = parser.parse_args(["--dataset-path", str(trace), "--model", args.model, "--sim-profile", args.sim_profile,
                            *hops.simulate_flags(latencies_ms or {})])
    return simulate.simulate(cfg.from_args(simulate.SimulateConfig, ns), cfg.from_args(SchedulerDaemonConfig, ns))


def realtime(args, trace: Path) -> dict:
    with ServeProcess(args.model, "--device", "sim", "--sim-profile", args.sim_profile) as serve:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        ns = parser.parse_args(["--target", serve.gateway_addr, "--scheduler", serve.scheduler_addr, f"--cluster-token={serve.cluster_token}",
                                "--dataset-name", "trace", "--dataset-path", str(trace), "--disable-tqdm",
                                "--num-prompts", str(args.num_requests)])
        return bench.bench(ns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sim-profile", default="h200")
    parser.add_argument("--model", default="llama3-8b-sim")
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s of the Poisson trace")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/crosscheck.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trace = args.out.with_suffix(".trace.jsonl")
    write_trace(trace, args.num_requests, args.rate, args.seed)
    calibration = hops.measure(args.model, args.sim_profile, num_requests=30, prompt_len=512)
    latencies = calibration["latencies_ms"]
    free, modelled = offline(args, trace), offline(args, trace, latencies)
    measured = realtime(args, trace)
    rows = {k: {"offline": free[k], "offline_modelled": modelled[k], "realtime": measured[k],
                "realtime_over_offline": measured[k] / free[k], "realtime_over_modelled": measured[k] / modelled[k]}
            for k in KEYS}
    rows["device_utilization"] = {"offline": free["device_utilization"],
                                  "offline_modelled": modelled["device_utilization"],
                                  "realtime": measured.get("device_utilization")}
    print("control-plane latencies (ms, lone requests):", {k: round(v, 2) for k, v in latencies.items()})
    print(f"{'metric':<22}{'free':>10}{'modelled':>10}{'real-time':>11}{'rt/free':>9}{'rt/model':>9}")
    for k in KEYS:
        r = rows[k]
        print(f"{k:<22}{r['offline']:>10.1f}{r['offline_modelled']:>10.1f}{r['realtime']:>11.1f}"
              f"{r['realtime_over_offline']:>9.2f}{r['realtime_over_modelled']:>9.2f}")
    within = {f"{k} {v}": abs(rows[k][f"realtime_over_{v}"] - 1) <= 0.15
              for k in ("median_ttft_ms", "median_tpot_ms") for v in ("offline", "modelled")}
    print("within 15 %:", within)
    args.out.write_text(json.dumps({"rows": rows, "within_15pct": within, "control_plane_latencies_ms": latencies,
                                    "hops_p50_ms": calibration["hops_p50_ms"], "rate": args.rate,
                                    "num_requests": args.num_requests, "sim_profile": args.sim_profile,
                                    "model": args.model}, indent=2))


if __name__ == "__main__":
    main()
