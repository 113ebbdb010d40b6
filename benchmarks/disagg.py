"""Goodput at SLO of disaggregated prefill/decode against aggregated replicas, in the offline
simulator (`stepahead simulate --replicas N` / `--prefill-replicas P --decode-replicas D`: the
real scheduler core per replica, the sim worker's cost model, a virtual clock).

    PYTHONPATH=. .venv/bin/python benchmarks/disagg.py --out benchmarks/results/disagg.json

Goodput (DistServe's): the highest request rate at which at least `--attainment` of the
requests meet both TTFT <= `--ttft-slo` and TPOT <= `--tpot-slo` (a request of one output
token has no TPOT: it meets it). Found per setup by bisection over the rate: the rate doubles
until the SLO attainment fails, then the bracket halves until it is within `--tolerance`.
Each run of a setup replays the same `--requests-per-replica` x replicas requests (long
prompts, short outputs: Azure-code-like, `cli.datasets.long_prompt_trace`, one seed), Poisson
arrivals at the rate tried. A fixed count for every setup would make the runs of big clusters
short in time, and the TTFT bound would then hide a growing queue.

Setups: `N` is N aggregated replicas (prefill and decode on each), `P:D` is P prefill replicas
handing their requests' KV over `--kv-link` to D decode replicas; every one has the same model,
profile and scheduler flags. For every setup the table shows the goodput, the goodput per
replica, and, at the lowest rate tried that missed the SLO, which bound the requests missed
(TTFT, TPOT, both) and the replicas' utilisations: where the time goes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from cli import simulate
from cli.datasets import long_prompt_trace, write_jsonl_trace
from scheduler_service.server import SchedulerDaemonConfig
from stepahead import config as cfg

DEFAULT_SETUPS = ("4", "2:2", "1:3", "3:1", "8", "4:4", "2:6", "6:2")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b-sim")
    p.add_argument("--sim-profile", default="h200")
    p.add_argument("--kv-link", default="ib")
    p.add_argument("--setups", nargs="+", default=list(DEFAULT_SETUPS), help="N (aggregated) or P:D")
    p.add_argument("--requests-per-replica", type=int, default=250,
                   help="requests per run: this many per replica of the setup (a run's length in time then "
                        "depends on the per-replica rate, not on the cluster's size)")
    p.add_argument("--num-requests", type=int, default=None, help="a fixed number of requests per run instead")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-median", type=int, default=24, help="output tokens: the log-normal's median")
    p.add_argument("--max-output", type=int, default=256, help="output tokens at most")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    p.add_argument("--tpot-slo", type=float, default=0.05, help="seconds")
    p.add_argument("--attainment", type=float, default=0.9, help="fraction of requests meeting both SLOs")
    p.add_argument("--start-rate", type=float, default=4.0, help="requests/s per replica the search starts at")
    p.add_argument("--tolerance", type=float, default=0.03, help="relative width of the final bracket")
    p.add_argument("--extra", nargs="*", default=[], help="more `stepahead simulate` flags for every run")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def setup_flags(setup: str) -> tuple[list[str], int]:
    """(the simulate flags of `setup`, its number of replicas)."""
    p, sep, d = setup.partition(":")
    if sep:
        return ["--prefill-replicas", p, "--decode-replicas", d], int(p) + int(d)
    return ["--replicas", setup], int(setup)


def num_requests(args, setup: str) -> int:
    return args.num_requests or args.requests_per_replica * setup_flags(setup)[1]


def run_sim(args, setup: str, rate: float, work: Path) -> dict:
    trace = long_prompt_trace(num_requests(args, setup), rate, args.seed, output_median=args.output_median,
                              max_output=args.max_output)
    path = write_jsonl_trace(work / f"trace-{rate:.6g}.jsonl", trace)
    flags, _ = setup_flags(setup)
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    ns = parser.parse_args(["--dataset-path", str(path), "--model", args.model, "--sim-profile", args.sim_profile,
                            "--kv-link", args.kv_link, "--seed", str(args.seed), *flags, *args.extra])
    return simulate.simulate(cfg.from_args(simulate.SimulateConfig, ns), cfg.from_args(SchedulerDaemonConfig, ns))


def slo_row(args, rate: float, result: dict) -> dict:
    """One run at `rate`: SLO attainment and which bound the requests missed."""
    ttft_miss = tpot_miss = both = 0
    ttfts, tpots = [], []
    for r in result["requests"]:
        times = r["token_times"]
        if not times:  # rejected: misses both
            ttft_miss, tpot_miss, both = ttft_miss + 1, tpot_miss + 1, both + 1
            continue
        ttft = times[0] - r["arrival"]
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        ttfts.append(ttft)
        tpots.append(tpot)
        a, b = ttft > args.ttft_slo, tpot > args.tpot_slo
        ttft_miss, tpot_miss, both = ttft_miss + a, tpot_miss + b, both + (a and b)
    n = len(result["requests"])
    met = n - (ttft_miss + tpot_miss - both)
    row = {"rate": rate, "attainment": met / n, "ttft_misses": ttft_miss, "tpot_misses": tpot_miss,
           "both_missed": both, "median_ttft_s": statistics.median(ttfts), "p90_ttft_s": _p90(ttfts),
           "median_tpot_ms": statistics.median(tpots) * 1e3, "p90_tpot_ms": _p90(tpots) * 1e3,
           "duration_s": result["duration"], "device_utilization": result["device_utilization"],
           "num_preemptions": result["num_preemptions"]}
    if "replicas" in result:
        row["utilization"] = {r["name"]: round(r["device_utilization"], 3) for r in result["replicas"]}
    if "kv_transfers" in result:
        t = result["kv_transfers"]
        row["kv_transfers"] = {"count": t["num_completed"], "gib": t["bytes"] / 2**30,
                               "mean_link_ms": t["mean_link_ms"], "mean_link_wait_ms": t["mean_link_wait_ms"]}
    return row


def _p90(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, math.ceil(0.9 * len(values)) - 1)]


def goodput(args, setup: str, work: Path) -> dict:
    """Bisection over the rate: the highest rate tried whose attainment holds, and every run."""
    _, replicas = setup_flags(setup)
    runs: list[dict] = []

    def attained(rate: float) -> bool:
        row = slo_row(args, rate, run_sim(args, setup, rate, work))
        runs.append(row)
        print(f"  {setup:>4} @ {rate:7.3f} req/s: attainment {row['attainment']:.1%} (TTFT misses "
              f"{row['ttft_misses']}, TPOT misses {row['tpot_misses']})", flush=True)
        return row["attainment"] >= args.attainment

    lo, hi = 0.0, args.start_rate * replicas
    while attained(hi):
        lo, hi = hi, hi * 2
    if lo == 0.0:  # the start rate already misses: search below it
        lo = hi / 2
        while not attained(lo) and lo > 1e-3:
            hi, lo = lo, lo / 2
    while (hi - lo) > args.tolerance * hi:
        mid = (lo + hi) / 2
        if attained(mid):
            lo = mid
        else:
            hi = mid
    by_rate = {r["rate"]: r for r in runs}
    return {"setup": setup, "replicas": replicas, "num_requests": num_requests(args, setup), "goodput_req_s": lo, "goodput_per_replica": lo / replicas,
            "at_goodput": by_rate.get(lo), "first_miss": by_rate[hi], "runs": sorted(runs, key=lambda r: r["rate"])}


def table(rows: list[dict]) -> str:
    lines = ["| setup | goodput req/s | per replica | at goodput: TTFT p90 s / TPOT p90 ms | first miss: rate, "
             "attainment, TTFT / TPOT / both missed | utilisation at the first miss |", "|" + "---|" * 6]
    for r in rows:
        g, m = r["at_goodput"] or {}, r["first_miss"]
        util = m.get("utilization") or {"all": m["device_utilization"]}
        lines.append(f"| {r['setup']} | {r['goodput_req_s']:.2f} | {r['goodput_per_replica']:.2f} | "
                     f"{g.get('p90_ttft_s', float('nan')):.2f} / {g.get('p90_tpot_ms', float('nan')):.1f} | "
                     f"{m['rate']:.2f}, {m['attainment']:.1%}, {m['ttft_misses']} / {m['tpot_misses']} / "
                     f"{m['both_missed']} | {', '.join(f'{k} {v:.2f}' for k, v in util.items())} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="disagg-") as tmp:
        for setup in args.setups:
            rows.append(goodput(args, setup, Path(tmp)))
    print(table(rows))
    by = {r["setup"]: r for r in rows}
    goal = None
    if "4" in by and "2:2" in by:
        ratio = by["2:2"]["goodput_req_s"] / by["4"]["goodput_req_s"]
        goal = {"goal": "disaggregated 2P+2D goodput >= 1.5x that of 4 aggregated replicas",
                "aggregated_req_s": by["4"]["goodput_req_s"], "disaggregated_req_s": by["2:2"]["goodput_req_s"],
                "ratio": ratio, "holds": ratio >= 1.5}
        print(json.dumps(goal))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "goal": goal}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
