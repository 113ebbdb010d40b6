"""Data-parallel scaling under one scheduler: output tok/s with 1, 2, 4, 8 sim replicas.

    PYTHONPATH=. .venv/bin/python benchmarks/replicas.py [--replicas 1 2 4 8] \
        [--streams-per-replica 256] [--input-len 128] [--output-len 128] [--gateways 2] \
        [--stream-interval 16] [--out benchmarks/results/replicas.json]

For each N: one scheduler, N `--device sim --sim-profile h200` workers serving
`llama3-8b-sim` (Llama-3-8B's geometry; the step time is the H200 roofline, no torch),
`--gateways` gateways; `stepahead bench`'s asyncio client (one channel per gateway, no
thread per stream) sends N x `--streams-per-replica` requests at once, alternating between
the gateways. Reported:

- output tok/s and scaling efficiency (tok/s / (N x tok/s at 1));
- each replica's device utilization from the flight record (its steps' busy seconds over
  the bench's window; the recorder keeps `--flight-recorder-steps` per replica, sized so the
  whole run fits), and the aggregate from the scheduler's counters;
- the scheduler process's CPU: in cores (1.0 = one core busy), per replica-step (CPU seconds
  over the steps of all replicas), and the replica count at which one scheduler core would
  saturate: the device's mean step over the CPU per replica-step (each replica at full
  utilization asks for one plan per device step);
- every process's CPU in cores, the load average and the machine's speed (`python_speed_ms`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path

from benchmarks.machine import cpu_seconds, python_speed_ms
from cli import bench as bench_mod
from cli.trace import fetch_records
from stepahead import security
from stepahead.flight_recorder import StepRecord
from stepahead.ports import free_port
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc
from testing.processes import spawn, spawn_gateway, wait_replicas, wait_serving

MODEL = "llama3-8b-sim"


def measure(n: int, args, model_dir: str) -> dict:
    token = secrets.token_urlsafe(16)
    env = {"STEPAHEAD_CLUSTER_TOKEN": token}
    sched_port = free_port()
    sched = f"127.0.0.1:{sched_port}"
    # a replica's run: its prefill chunks and output_len decode steps, with room to spare
    recorder_steps = 4 * (args.output_len + args.input_len * args.streams_per_replica // 512 + 64)
    scheduler = spawn("scheduler", "--port", str(sched_port), "--routing-policy", "least_loaded",
                      "--max-num-seqs", str(args.streams_per_replica), "--flight-recorder-steps", str(recorder_steps),
                      env=env)
    workers = [spawn("worker", "--scheduler", sched, "--model", model_dir, "--device", "sim",
                     "--sim-profile", "h200", env=env) for _ in range(n)]
    gateways = []
    try:
        wait_serving(sched)
        for _ in range(args.gateways):
            gateways.append(spawn_gateway(sched, model_dir, token, "--stream-interval", str(args.stream_interval)))
        with security.channel(sched, cluster_token=token) as ch:
            sched_stub = scheduler_pb2_grpc.SchedulerStub(ch)
            wait_replicas(sched_stub, n)
            speed = python_speed_ms()
            steps0 = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).num_steps
            pids = {"scheduler": scheduler.pid, **{f"worker{i}": w.pid for i, w in enumerate(workers)},
                    **{f"gateway{i}": g.pid for i, (g, _) in enumerate(gateways)}}
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            summary = bench_mod.bench(bench_args(args, n, [a for _, a in gateways], sched, token))
            cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
            steps = sched_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10).num_steps - steps0
        _, records = fetch_records(sched, token)
    finally:
        procs = [*(g for g, _ in gateways), *workers, scheduler]
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    window = summary["device_window"]
    per_replica = replica_utilization(records, window)
    wall = window[1] - window[0]
    device_step = summary["device_busy_s"] / max(steps, 1)  # the mean step of any replica
    per_replica_step = cpu["scheduler"] / max(steps, 1)
    return {
        "replicas": n, "streams": n * args.streams_per_replica, "completed": summary["completed"],
        "failed": summary["failed"], "errors": summary["errors"], "output_tokens": summary["total_output_tokens"],
        "duration_s": summary["duration"], "output_tok_s": summary["output_throughput"],
        "device_utilization": summary["device_utilization"] / n,  # all replicas' busy s / (N x wall)
        "replica_utilization": per_replica,
        "replica_steps_recorded": {k: v["steps"] for k, v in per_replica_steps(records, window).items()},
        "scheduler_steps": steps, "device_step_ms": device_step * 1e3,
        "scheduler_cpu_ms_per_replica_step": per_replica_step * 1e3,
        "scheduler_cpu_cores": cpu["scheduler"] / wall,
        "replicas_one_scheduler_core_saturates_at": device_step / per_replica_step if per_replica_step else None,
        "cpu_cores": {**{k: v / wall for k, v in cpu.items()}, "client": summary["client_cpu_s"] / wall},
        "median_tpot_ms": summary["median_tpot_ms"], "p99_tpot_ms": summary["p99_tpot_ms"],
        "median_ttft_ms": summary["median_ttft_ms"],
        "load_average": os.getloadavg()[0], "python_speed_ms": speed,
    }


def bench_args(args, n: int, targets: list[str], sched: str, token: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_mod.add_arguments(parser)
    return parser.parse_args([
        "--target", ",".join(targets), "--scheduler", sched, f"--cluster-token={token}",
        "--num-prompts", str(n * args.streams_per_replica), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm", "--label", f"replicas-{n}"])


def per_replica_steps(records: list[StepRecord], window: list[float]) -> dict[str, dict]:
    """Each replica's steps that ran inside the bench's window (wall clock): count, busy s."""
    out: dict[str, dict] = {}
    for r in records:
        if window[0] <= r.worker.forward_start and r.worker.forward_end <= window[1]:
            lane = out.setdefault(r.replica, {"steps": 0, "busy_s": 0.0})
            lane["steps"] += 1
            lane["busy_s"] += r.worker.device_busy_s
    return out


def replica_utilization(records: list[StepRecord], window: list[float]) -> dict[str, float]:
    """Busy seconds over the window's wall seconds, per replica (by worker id)."""
    wall = window[1] - window[0]
    return {k: v["busy_s"] / wall for k, v in sorted(per_replica_steps(records, window).items())}


def saturation_fit(rows: list[dict]) -> float | None:
    """Replicas at which the scheduler's measured cores reach 1.0, from a least-squares line
    through (replicas, scheduler cores) of the runs; None with fewer than two runs or a flat line."""
    if len(rows) < 2:
        return None
    xs, ys = [r["replicas"] for r in rows], [r["scheduler_cpu_cores"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:
        return None
    return (1.0 - (my - slope * mx)) / slope


def line(r: dict) -> str:
    utils = " ".join(f"{u:.0%}" for u in r["replica_utilization"].values())
    sat = r["replicas_one_scheduler_core_saturates_at"]
    return (f"{r['replicas']} x {r['streams'] // r['replicas']} streams: {r['output_tok_s']:.0f} tok/s, "
            f"efficiency {r['scaling_efficiency']:.2f}, util {r['device_utilization']:.0%} (per replica: {utils}); "
            f"scheduler {r['scheduler_cpu_cores']:.2f} cores, {r['scheduler_cpu_ms_per_replica_step']:.2f} ms CPU per "
            f"replica-step of {r['device_step_ms']:.1f} ms -> one core saturates at "
            f"{'–' if sat is None else f'{sat:.1f}'} replicas; CPU cores "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items())
            + f"; load {r['load_average']:.1f}, py {r['python_speed_ms']:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--streams-per-replica", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--stream-interval", type=int, default=1, help="the gateways' --stream-interval")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/replicas.json"))
    args = parser.parse_args()
    for name in ("gateways", "streams_per_replica", "input_len", "output_len", "stream_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.replicas) < 1:
        parser.error(f"--replicas must all be >= 1, got {args.replicas}")
    from model_zoo.builtin_models import resolve_model

    model_dir = str(resolve_model(MODEL))
    rows = []
    for n in args.replicas:
        row = measure(n, args, model_dir)
        row["scaling_efficiency"] = row["output_tok_s"] / (n * rows[0]["output_tok_s"] / rows[0]["replicas"]) \
            if rows else 1.0
        rows.append(row)
        print(line(row), flush=True)
        write(args, rows)
    fit = saturation_fit(rows)
    print(f"scheduler cores vs replicas, fitted: one core saturates at "
          f"{'–' if fit is None else f'{fit:.1f}'} replicas")
    write(args, rows, fit)


def write(args, rows: list[dict], fit: float | None = None) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": MODEL, "profile": "h200", "streams_per_replica": args.streams_per_replica,
        "input_len": args.input_len, "output_len": args.output_len, "gateways": args.gateways,
        "stream_interval": args.stream_interval, "cpus": os.cpu_count(),
        "replicas_one_scheduler_core_saturates_at_fitted": fit, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
