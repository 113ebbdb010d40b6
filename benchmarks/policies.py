"""Scheduling quality of fcfs, priority and score on the offline simulator (`stepahead simulate`).

    PYTHONPATH=. .venv/bin/python benchmarks/policies.py --sim-profile h100 --model llama3-8b-sim \
        --num-requests 1500 --out benchmarks/results/policies.json

The profile's capacity (requests/s) is measured first: every request at once, fcfs. Then
Poisson traces at 0.5x, 1.0x and 1.5x that rate with three priority classes (10 % priority
0, 30 % priority 1, 60 % priority 2) run under each policy. Reported per class: TTFT p50 /
p99, TPOT p99; overall: max queue wait (arrival to first schedule) vs the aging bound
(`--max-wait-time`), preemptions, goodput (share of requests with TTFT <= 2 s and TPOT <=
100 ms). Goals: at 1.5x, priority 0's p99 TTFT <= 2x its value at 0.5x; under score no
request waits longer than the aging bound; score's goodput >= fcfs's. Score runs with
`--score-ttft-target` = this goodput's TTFT target (2 s; `--score-ttft-target 0`: without).

`--arrivals bursty` replaces the Poisson trace with the shape of the Azure LLM inference
trace's conversation service (issue 37; no real trace ships here): bursts (Gamma inter-arrival
times of coefficient of variation `--burst-cv`, the rate switching between busy and calm
phases `--burst-ratio` times apart, at the same mean rate) and heavy-tailed lengths
(`bursty_rows`; with `--prompt-len 8 7000 --output-len 1 1000`: prompts of median ~1 k and
p99 ~4.6 k tokens, outputs of median ~150 and p99 ~1.4 k). `--capacity R` skips the capacity
run and takes R requests/s. Every row reports preemptions per request (mean, max).

    PYTHONPATH=. .venv/bin/python benchmarks/policies.py --sim-profile h200 --num-requests 5000 \
        --arrivals bursty --prompt-len 8 7000 --output-len 1 1000 --seed 1 --capacity 22.71334

replays the trace on which score livelocked at 1.5x before the progress fix
(`tests/sim/test_overload_progress.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
from pathlib import Path

from scheduler_service.server import SchedulerDaemonConfig
from stepahead import config as cfg
from cli import simulate

CLASSES = ((0, 0.1), (1, 0.3), (2, 0.6))
POLICIES = ("fcfs", "priority", "score")
LOADS = (0.5, 1.0, 1.5)
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.1


def write_trace(path: Path, n: int, rate: float, seed: int, prompt: tuple[int, int], output: tuple[int, int],
                arrivals: str = "poisson", burst_cv: float = 2.5, burst_ratio: float = 4.0,
                burst_phase_s: float = 20.0) -> Path:
    rng = random.Random(seed)
    if arrivals == "bursty":
        rows = bursty_rows(rng, n, rate, prompt, output, burst_cv, burst_ratio, burst_phase_s)
    else:
        t, rows = 0.0, []
        for _ in range(n):
            priority = rng.choices([c for c, _ in CLASSES], [w for _, w in CLASSES])[0]
            rows.append({"arrival_s": t, "prompt_len": rng.randint(*prompt), "output_len": rng.randint(*output),
                         "priority": priority})
            t += rng.expovariate(rate) if rate != float("inf") else 0.0
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def bursty_rows(rng: random.Random, n: int, rate: float, prompt: tuple[int, int], output: tuple[int, int],
                cv: float, ratio: float, phase_s: float) -> list[dict]:
    """Arrivals at mean `rate` in bursts: Gamma gaps of coefficient of variation `cv`, the rate
    `ratio` times higher in busy phases than in calm ones (phases of exponential length, mean
    `phase_s`, as much time busy as calm). Lengths of the conversation trace's shape:
    log-normal prompts (median 1,020 tokens) and outputs (median 150), clipped to
    `prompt` and to `output`'s low end, prompt + output at most `prompt[1] + output[1]`."""
    shape, busy, calm = 1 / cv**2, 2 * ratio / (ratio + 1), 2 / (ratio + 1)
    t, state, switch, rows = 0.0, 0, rng.expovariate(1 / phase_s), []
    for _ in range(n):
        if rate != float("inf"):
            t += rng.gammavariate(shape, 1 / (shape * rate * (busy if state else calm)))
        while t > switch:
            state, switch = state ^ 1, switch + rng.expovariate(1 / phase_s)
        p = min(prompt[1], max(prompt[0], int(rng.lognormvariate(math.log(1020), 0.65))))
        o = min(prompt[1] + output[1] - p, max(output[0], int(rng.lognormvariate(math.log(150), 0.95))))
        priority = rng.choices([c for c, _ in CLASSES], [w for _, w in CLASSES])[0]
        rows.append({"arrival_s": t, "prompt_len": p, "output_len": o, "priority": priority})
    return rows


def steady_rate(requests: list[dict]) -> float:
    """Requests finished per second between the 10th and the 90th percentile of finish times
    (the ramp-up and the drain of a burst excluded)."""
    finishes = sorted(r["finish"] for r in requests)
    lo, hi = len(finishes) // 10, len(finishes) * 9 // 10
    return (hi - lo) / (finishes[hi] - finishes[lo])


def run_sim(args, trace: Path, policy: str) -> dict:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    ns = parser.parse_args(["--dataset-path", str(trace), "--model", args.model, "--sim-profile", args.sim_profile,
                            "--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs),
                            "--max-wait-time", str(args.max_wait_time),
                            "--score-ttft-target", str(args.score_ttft_target), *args.extra])
    return simulate.simulate(cfg.from_args(simulate.SimulateConfig, ns), cfg.from_args(SchedulerDaemonConfig, ns))


def quality(result: dict, max_wait: float) -> dict:
    reqs = result["requests"]
    good = 0
    for r in reqs:
        times = r["token_times"]
        ttft = times[0] - r["arrival"]
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        good += ttft <= TTFT_SLO_S and tpot <= TPOT_SLO_S
    waits = [r["first_scheduled"] - r["arrival"] for r in reqs]
    return {
        "goodput": good / len(reqs), "max_queue_wait_s": max(waits), "aging_bound_s": max_wait,
        "num_preemptions": result["num_preemptions"], "output_throughput": result["output_throughput"],
        "preemptions_per_request": result["num_preemptions"] / len(reqs),
        "max_preemptions_per_request": result["max_preemptions_per_request"],
        "classes": {p: {k: v[k] for k in ("median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "num_requests")}
                    for p, v in result["by_priority"].items()},
    }


def table(rows: list[dict]) -> str:
    lines = ["| load | policy | p0 TTFT p50/p99 ms | p1 TTFT p50/p99 ms | p2 TTFT p50/p99 ms | TPOT p99 ms (p0/p1/p2) "
             "| max wait s (bound) | preemptions (per request, max) | goodput |", "|" + "---|" * 9]
    for r in rows:
        c = r["classes"]
        ttft = " | ".join(f"{c[p]['median_ttft_ms']:.0f} / {c[p]['p99_ttft_ms']:.0f}" for p in ("0", "1", "2"))
        tpot = " / ".join(f"{c[p]['p99_tpot_ms']:.0f}" for p in ("0", "1", "2"))
        lines.append(f"| {r['load']}x | {r['policy']} | {ttft} | {tpot} | {r['max_queue_wait_s']:.1f} "
                     f"({r['aging_bound_s']:.0f}) | {r['num_preemptions']} ({r['preemptions_per_request']:.2f}, "
                     f"{r['max_preemptions_per_request']}) | {r['goodput']:.1%} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[str]:
    by = {(r["load"], r["policy"]): r for r in rows}
    out = []
    for policy in POLICIES:
        lo, hi = by[(0.5, policy)]["classes"]["0"]["p99_ttft_ms"], by[(1.5, policy)]["classes"]["0"]["p99_ttft_ms"]
        out.append(f"{policy}: priority-0 p99 TTFT at 1.5x = {hi:.0f} ms vs 2 x {lo:.0f} ms at 0.5x: "
                   f"{'holds' if hi <= 2 * lo else 'MISSED'}")
    for load in LOADS:
        s = by[(load, "score")]
        out.append(f"score at {load}x: max queue wait {s['max_queue_wait_s']:.1f} s vs aging bound "
                   f"{s['aging_bound_s']:.0f} s: {'holds' if s['max_queue_wait_s'] <= s['aging_bound_s'] else 'MISSED'}")
        f = by[(load, "fcfs")]
        out.append(f"goodput at {load}x: score {s['goodput']:.1%} vs fcfs {f['goodput']:.1%}: "
                   f"{'holds' if s['goodput'] >= f['goodput'] else 'MISSED'}")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy in POLICIES:
        mine = [r for r in rows if r["policy"] == policy]
        a.plot([r["load"] for r in mine], [r["classes"]["0"]["p99_ttft_ms"] for r in mine], "-o", label=policy)
        b.plot([r["load"] for r in mine], [r["goodput"] for r in mine], "-o", label=policy)
    a.set_title("priority-0 p99 TTFT (ms)")
    a.set_yscale("log")
    b.set_title(f"goodput (TTFT <= {TTFT_SLO_S:.0f} s, TPOT <= {TPOT_SLO_S * 1e3:.0f} ms)")
    for ax in (a, b):
        ax.set_xlabel("offered load / capacity")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sim-profile", default="h100")
    parser.add_argument("--model", default="llama3-8b-sim")
    parser.add_argument("--num-requests", type=int, default=1500)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-wait-time", type=float, default=30.0)
    parser.add_argument("--score-ttft-target", type=float, default=TTFT_SLO_S,
                        help="the score policy's TTFT target, seconds (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson",
                        help="bursty: the conversation trace's shape (bursts, heavy-tailed lengths)")
    parser.add_argument("--capacity", type=float, default=None, help="requests/s; default: measured")
    parser.add_argument("--burst-cv", type=float, default=2.5, help="bursty: CV of the inter-arrival times")
    parser.add_argument("--burst-ratio", type=float, default=4.0, help="bursty: busy / calm rate")
    parser.add_argument("--burst-phase-s", type=float, default=20.0, help="bursty: mean phase length, seconds")
    parser.add_argument("--extra", nargs="*", default=[], help="more scheduler flags for every run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/policies.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="policies-") as tmp:
        run_all(args, Path(tmp))


def trace_for(args, path: Path, rate: float) -> Path:
    return write_trace(path, args.num_requests, rate, args.seed, args.prompt_len, args.output_len, args.arrivals,
                       args.burst_cv, args.burst_ratio, args.burst_phase_s)


def run_all(args, work: Path) -> None:
    capacity = args.capacity
    if capacity is None:
        saturated = run_sim(args, trace_for(args, work / "burst.jsonl", float("inf")), "fcfs")
        capacity = steady_rate(saturated["requests"])
        print(f"capacity: {capacity:.2f} requests/s (steady state of a burst of {args.num_requests}, fcfs) "
              f"on {args.sim_profile} with {args.model}", flush=True)
    rows = []
    for load in LOADS:
        trace = trace_for(args, work / f"load{load}.jsonl", load * capacity)
        for policy in POLICIES:
            rows.append({"load": load, "policy": policy, **quality(run_sim(args, trace, policy), args.max_wait_time)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    verdicts = goals(rows)
    print("\n".join(verdicts))
    args.out.write_text(json.dumps({"capacity_req_s": capacity, "rows": rows, "goals": verdicts,
                                    "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
