"""Where the device's idle time comes from: the async loop's critical chain, step by step.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/critical_chain.py --streams 256 \
        --windows 2 3 auto --out benchmarks/results/critical_chain_256.json

With W plans in flight (a fixed window; `auto`, the scheduler's default, keeps two and plans a
third only while the device waits: its chain is split as W = 2), plan s is built when the result of step s-W is committed, and must
reach the worker before step s-1 ends on the device, or the device idles. This runs the
capacity workload (`stepahead serve --device sim`, h200 + llama3-8b-sim, 512-token prompts,
256 outputs, every request at once), fetches the scheduler's flight record and, for every
step the device waited for, splits the chain from the end of step s-W on the device to the
launch of step s:

- *result → commit*: the worker's result leaves, the scheduler's reader parses it, the engine
  thread picks it up;
- *update*: the engine commits it (`update_from_output`) and starts planning;
- *schedule*: `Scheduler.schedule()` for step s;
- *plan → worker*: encode, the hand-off to the stream's writer, gRPC, the worker's receipt;
- *worker prep*: the worker parses and applies the plan and launches the step.

It also gives the device's utilization in the decode phase (steps of at most one token per
stream) and in the steps carrying prefill chunks, separately: the chain has to fit in one
decode step (~10 ms at 256 streams on the h200 profile) and is widest there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import urllib.request
from pathlib import Path

from benchmarks import capacity
from benchmarks.machine import python_speed_ms
from cli import bench
from testing.launcher import ServeProcess
from stepahead.ports import free_port
from cli.trace import fetch_records
from stepahead.flight_recorder import StepRecord

SEGMENTS = ("result → commit", "update", "schedule", "plan → worker", "worker prep")


def chain(base: StepRecord, r: StepRecord) -> dict[str, float]:
    """Seconds of each segment from the end of step `base` on the device to the launch of `r`."""
    return {
        "result → commit": base.commit_start - base.worker.forward_end,
        "update": r.schedule_start - base.commit_start,
        "schedule": r.schedule_end - r.schedule_start,
        "plan → worker": r.worker.plan_received - r.schedule_end,
        "worker prep": r.worker.forward_start - r.worker.plan_received,
    }


def analyse(records: list[StepRecord], window: int, streams: int, since: float = 0.0) -> dict:
    """`since`: the bench's window start (wall clock); steps before it (the warm-up) are left out."""
    by_id = {r.step_id: r for r in records}
    phases = capacity.phase_totals(records, streams, since)  # busy, wall, steps
    waits, parts = [], {k: [] for k in SEGMENTS}
    for r in records:
        prev, base = by_id.get(r.step_id - 1), by_id.get(r.step_id - window)
        if prev is None or not (r.worker.forward_start and prev.worker.forward_end) or prev.worker.forward_end < since:
            continue
        idle = r.worker.forward_start - prev.worker.forward_end
        if idle > 0.0002 and base is not None:  # the device waited for this plan
            waits.append(idle)
            for k, v in chain(base, r).items():
                parts[k].append(v)
    ms = lambda xs: {"mean": statistics.mean(xs) * 1e3, "p50": statistics.median(xs) * 1e3} if xs else None
    return {
        "utilization": {k: busy / wall if wall else None for k, (busy, wall, _) in phases.items()},
        "steps": {k: n for k, (_, _, n) in phases.items()},
        "decode_step_ms": phases["decode"][0] / max(phases["decode"][2], 1) * 1e3,
        "idle_steps": len(waits), "idle_ms_total": sum(waits) * 1e3, "idle_ms": ms(waits),
        "chain_ms_on_idle_steps": {k: ms(v) for k, v in parts.items()},
    }


def scrape_total(port: int, name: str) -> float:
    """The sum of a metric family's samples (every replica's) on the scheduler's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


def late_fraction(port: int) -> float:
    """Steps the device waited for although their plan was made as soon as the window allowed."""
    steps = scrape_total(port, "stepahead:scheduler_steps_total")
    return scrape_total(port, "stepahead:late_plans_total") / steps if steps else 0.0


def window_flags(window: str) -> list[str]:
    """"2", "3": a fixed window of that many plans; "auto": the default, adaptive up to 3."""
    if window == "auto":
        return ["--max-concurrent-batches", "3", "--adaptive-concurrent-batches"]
    return ["--max-concurrent-batches", window, "--no-adaptive-concurrent-batches"]


def run(window: str, streams: int, args) -> dict:
    flags = ["--device", "sim", "--sim-profile", "h200", "--max-num-seqs", str(streams), "--async-scheduling",
             *window_flags(window)]
    speed = python_speed_ms()
    port = free_port()
    with ServeProcess("llama3-8b-sim", *flags, "--metrics-port", str(port)) as serve:
        summary = bench.bench(capacity.bench_args(serve, streams, args, f"chain-w{window}"))
        _, records = fetch_records(serve.scheduler_addr, serve.cluster_token)
        late = late_fraction(port)
    # the chain of an adaptive window is measured from its base (one step ahead): when it has
    # deepened, a step's plan had one step more of slack than the split assumes
    out = analyse(sorted(records, key=lambda r: r.step_id), 2 if window == "auto" else int(window), streams,
                  summary["device_window"][0])
    out.update(window=window, streams=streams, device_utilization=summary["device_utilization"],
               client_vs_ideal=summary["output_throughput"] / summary["device_ideal_output_throughput"],
               late_steps=late, python_speed_ms=speed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--windows", nargs="+", default=["2", "3", "auto"], choices=["1", "2", "3", "4", "auto"],
                        help="fixed windows (plans in flight) and/or auto (the default adaptive window, up to 3)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the windows this many times")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.input_len, args.output_len, args.stream_interval = 512, 256, 1
    rows = []
    for _ in range(args.rounds):
        for window in args.windows:
            row = run(window, args.streams, args)
            rows.append(row)
            util, chain_ms = row["utilization"], row["chain_ms_on_idle_steps"]
            print(f"window {window}: util {row['device_utilization']:.1%} (decode {util['decode']:.1%}, prefill "
                  f"{util['prefill']:.1%}), decode step {row['decode_step_ms']:.1f} ms, device waited on "
                  f"{row['idle_steps']} steps for {row['idle_ms_total']:.0f} ms, late {row['late_steps']:.1%} of "
                  f"steps, py ms {row['python_speed_ms']:.0f}")
            for k, v in chain_ms.items():
                if v:
                    print(f"    {k:16s} p50 {v['p50']:6.2f} ms  mean {v['mean']:6.2f} ms")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
