"""Scheduling quality of fcfs, priority and score under overload, on the offline simulator
(`stepahead simulate`), with the arrival and length shapes of real production traffic.

    PYTHONPATH=. .venv/bin/python benchmarks/policies.py --out benchmarks/results/policies.json

Traces (`--traces conv code`): the Azure LLM inference trace 2023 (conversation and code
services), replayed as it is: its first `--num-requests` rows, with their real prompt and
output lengths and their real inter-arrival times (burstiness kept), only rescaled to each
load. The repository ships the first 5,147 conversation rows and the first 3,000 code rows
(`benchmarks/data/azure_llm_2023/`, CC-BY 4.0); `--azure-csv conv=PATH` replays a whole
downloaded file (`TIMESTAMP,ContextTokens,GeneratedTokens`, parsed by `cli.datasets`).
`--generated` replaces each trace by a stand-in generated from its published shape (`SHAPES`,
`bursty_rows`): bursts (Gamma inter-arrival times of coefficient of variation `--burst-cv`, the
rate switching between busy and calm phases `--burst-ratio` times apart, at the same mean rate)
and log-normal lengths of the service's median and spread (conversation: prompts of median
1,020 tokens, outputs of median 150; code: prompts of median 1,500, outputs of median 13).
Priority classes are drawn per request: 10 % priority 0, 30 % priority 1, 60 % priority 2.

Per trace the profile's capacity (requests/s: fcfs's steady finish rate when every request
arrives at once) is measured first (`--capacity conv=R`: given), then the trace runs at 0.5x,
1.0x and 1.5x of it under each policy, all with the same flags (`--max-wait-time`,
`--max-expected-wait`, `--preemption-min-progress`, `--extra`). Reported per class: TTFT p50 /
p99, TPOT p99; overall: TTFT p99, TPOT p99, preemptions (per request: mean, max), the longest
queue wait (arrival to first schedule) and how many waited past the aging bound
(`--max-wait-time`), requests shed by admission control (`--max-expected-wait`: refused with
QUEUE_FULL), and goodput: the share of *offered* requests (shed ones count as missed) with
TTFT <= 2 s and TPOT <= 100 ms.

Goals (issue 37), checked per trace under score: at 1.5x priority 0's p99 TTFT <= 2x its value
at 0.5x; TPOT p99 at 1.5x <= 2x its value at 0.5x (the reference load: the unloaded value is
not measured apart); no request waits past the aging bound at any load; goodput >= fcfs's and
>= priority's at every load; every run finishes (`SimulationStalled` otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from testing.overload import (  # noqa: F401 (POLICIES, TTFT_SLO_S, run_sim: benchmarks/policies_realtime.py)
    AZURE_TRACES, POLICIES, SHAPES, TTFT_SLO_S, _priority, azure_rows, bursty_rows, quality, run_sim, write_trace,
)

LOADS = (0.5, 1.0, 1.5)


def poisson_trace(path: Path, n: int, rate: float, seed: int, prompt: tuple[int, int],
                  output: tuple[int, int]) -> Path:
    """Poisson arrivals at `rate`, uniform lengths in `prompt` and `output`, the priority
    classes (`benchmarks/policies_realtime.py`'s traces)."""
    rng, t, rows = random.Random(seed), 0.0, []
    for _ in range(n):
        rows.append({"arrival_s": t, "prompt_len": rng.randint(*prompt), "output_len": rng.randint(*output),
                     "priority": _priority(rng)})
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return write_trace(path, rows)


def steady_rate(requests: list[dict]) -> float:
    """Requests finished per second between the 10th and the 90th percentile of finish times
    (the ramp-up and the drain of a burst excluded)."""
    finishes = sorted(r["finish"] for r in requests)
    lo, hi = len(finishes) // 10, len(finishes) * 9 // 10
    return (hi - lo) / (finishes[hi] - finishes[lo])


def table(rows: list[dict]) -> str:
    lines = ["| trace | load | policy | p0 TTFT p50 / p99 ms | p1 TTFT p99 | p2 TTFT p99 | all TTFT p99 ms | TPOT p99 ms "
             "(p0/p1/p2) | preemptions (per req, max) | max wait s | waits > bound | shed (p0/p1/p2; after queueing) | goodput |",
             "|" + "---|" * 13]
    for r in rows:
        c = r["classes"]
        shed = "/".join(str(c[p]["num_shed"]) for p in ("0", "1", "2"))
        lines.append(
            f"| {r['trace']} | {r['load']}x | {r['policy']} | {c['0']['median_ttft_ms']:.0f} / "
            f"{c['0']['p99_ttft_ms']:.0f} | {c['1']['p99_ttft_ms']:.0f} | {c['2']['p99_ttft_ms']:.0f} | "
            f"{r['all']['p99_ttft_ms']:.0f} | {r['all']['p99_tpot_ms']:.0f} ({c['0']['p99_tpot_ms']:.0f}/"
            f"{c['1']['p99_tpot_ms']:.0f}/{c['2']['p99_tpot_ms']:.0f}) | {r['num_preemptions']} "
            f"({r['preemptions_per_request']:.2f}, {r['max_preemptions_per_request']}) | "
            f"{r['max_queue_wait_s']:.1f} | {r['waits_over_bound']} | {r['num_shed']} ({shed}; {r['num_shed_queued']}) | {r['goodput']:.1%} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[tuple[str, bool]]:
    """(verdict, holds) of every goal, per trace, for the score policy."""
    by = {(r["trace"], r["load"], r["policy"]): r for r in rows}
    out = []
    for trace in sorted({r["trace"] for r in rows}):
        lo, hi = by[(trace, LOADS[0], "score")], by[(trace, LOADS[-1], "score")]
        a, b = lo["classes"]["0"]["p99_ttft_ms"], hi["classes"]["0"]["p99_ttft_ms"]
        out.append((f"{trace}: score priority-0 p99 TTFT at {LOADS[-1]}x = {b:.0f} ms vs 2 x {a:.0f} ms at "
                    f"{LOADS[0]}x", b <= 2 * a))
        a, b = lo["all"]["p99_tpot_ms"], hi["all"]["p99_tpot_ms"]
        out.append((f"{trace}: score TPOT p99 at {LOADS[-1]}x = {b:.0f} ms vs 2 x {a:.0f} ms at {LOADS[0]}x",
                    b <= 2 * a))
        for load in LOADS:
            s = by[(trace, load, "score")]
            out.append((f"{trace} {load}x: score requests waiting past the aging bound: {s['waits_over_bound']} "
                        f"(max wait {s['max_queue_wait_s']:.1f} s, bound {s['aging_bound_s']:.0f} s)",
                        s["waits_over_bound"] == 0))
            f, p = by[(trace, load, "fcfs")], by[(trace, load, "priority")]
            out.append((f"{trace} {load}x: goodput score {s['goodput']:.1%} vs fcfs {f['goodput']:.1%}, priority "
                        f"{p['goodput']:.1%}", s["goodput"] >= f["goodput"] and s["goodput"] >= p["goodput"]))
    return out


def rows_for(args, trace: str, rate: float) -> list[dict]:
    if not args.generated:
        return azure_rows(Path(args.azure_csv.get(trace, AZURE_TRACES[trace])), args.num_requests, rate, args.seed)
    return bursty_rows(random.Random(args.seed), args.num_requests, rate, SHAPES[trace], args.burst_cv,
                       args.burst_ratio, args.burst_phase_s)


def measure(args, work: Path, trace: str, policies=POLICIES, loads=LOADS) -> tuple[float, list[dict]]:
    """(capacity, rows) of one trace."""
    capacity = args.capacity.get(trace)
    if capacity is None:
        burst = write_trace(work / f"{trace}-burst.jsonl", rows_for(args, trace, float("inf")))
        capacity = steady_rate(run_sim(args, burst, "fcfs")["requests"])
        print(f"{trace}: capacity {capacity:.3f} requests/s (fcfs, every request at once)", flush=True)
    rows = []
    for load in loads:
        path = write_trace(work / f"{trace}-{load}.jsonl", rows_for(args, trace, load * capacity))
        for policy in policies:
            row = {"trace": trace, "load": load, "policy": policy,
                   **quality(run_sim(args, path, policy), args.max_wait_time)}
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    return capacity, rows


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, value = v.partition("=")
        if not sep or name not in SHAPES:
            raise SystemExit(f"{what}: expected TRACE=VALUE with TRACE in {sorted(SHAPES)}, got {v!r}")
        out[name] = value
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", nargs="+", choices=sorted(SHAPES), default=["conv", "code"])
    p.add_argument("--azure-csv", nargs="*", default=[], metavar="TRACE=PATH",
                   help="replay this Azure trace CSV (a whole downloaded file) instead of the rows that ship in "
                   "benchmarks/data/azure_llm_2023/")
    p.add_argument("--generated", action="store_true",
                   help="generate each trace from its published shape (bursty_rows) instead of replaying the real one")
    p.add_argument("--sim-profile", default="h200")
    p.add_argument("--model", default="llama3-8b-sim")
    p.add_argument("--num-requests", type=int, default=1500)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-wait-time", type=float, default=30.0, help="the aging bound, seconds")
    p.add_argument("--score-ttft-target", type=float, default=TTFT_SLO_S)
    p.add_argument("--max-expected-wait", type=float, default=None, help="admission control, seconds (off)")
    p.add_argument("--preemption-min-progress", type=int, default=None, help="tokens (the scheduler's default)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--capacity", nargs="*", default=[], metavar="TRACE=R", help="requests/s; default: measured")
    p.add_argument("--burst-cv", type=float, default=2.5, help="CV of the inter-arrival times")
    p.add_argument("--burst-ratio", type=float, default=4.0, help="busy / calm rate")
    p.add_argument("--burst-phase-s", type=float, default=20.0, help="mean phase length, seconds")
    p.add_argument("--extra", nargs="*", default=[], help="more scheduler flags for every run")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/policies.json"))
    return p


def main() -> None:
    args = parser().parse_args()
    args.azure_csv = _pairs(args.azure_csv, "--azure-csv")
    args.capacity = {k: float(v) for k, v in _pairs(args.capacity, "--capacity").items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    capacities, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="policies-") as tmp:
        for trace in args.traces:
            capacities[trace], mine = measure(args, Path(tmp), trace)
            rows += mine
    print(table(rows))
    verdicts = goals(rows)
    print("\n".join(f"{text}: {'holds' if ok else 'MISSED'}" for text, ok in verdicts))
    args.out.write_text(json.dumps({
        "capacity_req_s": capacities, "rows": rows,
        "goals": [{"goal": text, "holds": ok} for text, ok in verdicts],
        "trace_source": {t: ("generated from the published shape" if args.generated
                             else str(args.azure_csv.get(t, AZURE_TRACES[t].relative_to(AZURE_TRACES[t].parents[3]))))
                         for t in args.traces},
        "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))


if __name__ == "__main__":
    main()
