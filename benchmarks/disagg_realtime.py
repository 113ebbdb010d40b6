"""The offline simulator's disaggregation verdict checked against the real-time daemons.

    PYTHONPATH=. .venv/bin/python benchmarks/disagg_realtime.py --setups 4 3:1 --rates 56 66 \
        --num-requests 600 --out benchmarks/results/disagg_realtime.json

For each setup (N: N aggregated replicas; P:D: P prefill + D decode replicas) and rate, the same
trace (`cli.datasets.long_prompt_trace`, as `benchmarks/disagg.py`) runs twice: through
`stepahead simulate` (the offline verdict, `disagg.py`'s SLO rows) and through
`stepahead serve --device sim` (sim workers as real processes with their roles, KV loads over
real gRPC between them, waiting the link's time) with `stepahead bench --dataset-name trace`
replaying the arrivals. Reported: SLO attainment (TTFT <= 2 s and TPOT <= 50 ms) and TTFT / TPOT
p90 of both. The real-time side adds this machine's control plane (2 vCPUs for every daemon
and the client), so it is read for the ordering of the setups, not their absolute rates.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks import disagg
from cli import bench
from cli.datasets import long_prompt_trace, write_jsonl_trace
from testing.launcher import ServeProcess


def serve_flags(setup: str) -> list[str]:
    p, sep, d = setup.partition(":")
    return ["--prefill-replicas", p, "--decode-replicas", d] if sep else ["--data-parallel-size", setup]


def realtime(args, setup: str, trace_path: Path, work: Path) -> dict:
    out = work / f"bench-{setup.replace(':', '-')}.json"
    with ServeProcess(args.model, "--device", "sim", "--sim-profile", args.sim_profile, "--sim-kv-link", args.kv_link,
                      *serve_flags(setup)) as serve:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        ns = parser.parse_args(["--target", serve.gateway_addr, "--scheduler", serve.scheduler_addr,
                                f"--cluster-token={serve.cluster_token}", "--dataset-name", "trace",
                                "--dataset-path", str(trace_path), "--disable-tqdm", "--ignore-eos",
                                "--num-prompts", str(args.num_requests), "--result-filename", str(out)])
        bench.bench(ns)
        stats = serve.stats()
    requests = json.loads(out.read_text())["requests"]
    met, ttfts, tpots = 0, [], []
    for r in requests:
        if r["error"] or not r["first_token"]:
            continue
        ttft = r["first_token"] - r["start"]
        tpot = (r["end"] - r["first_token"]) / (r["output_len"] - 1) if r["output_len"] > 1 else 0.0
        ttfts.append(ttft)
        tpots.append(tpot)
        met += ttft <= args.ttft_slo and tpot <= args.tpot_slo
    return {"attainment": met / len(requests), "p90_ttft_s": disagg._p90(ttfts), "p90_tpot_ms": disagg._p90(tpots) * 1e3,
            "errors": sum(bool(r["error"]) for r in requests), "num_handoffs": stats.num_handoffs,
            "num_loaded_blocks": stats.num_loaded_blocks, "num_failed_loads": stats.num_failed_loads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b-sim")
    p.add_argument("--sim-profile", default="h200")
    p.add_argument("--kv-link", default="ib")
    p.add_argument("--setups", nargs="+", default=["4", "3:1"])
    p.add_argument("--rates", type=float, nargs="+", default=[56.0, 66.0])
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tpot-slo", type=float, default=0.05)
    p.add_argument("--out", default="")
    args = p.parse_args()
    sim_args = argparse.Namespace(**vars(args), extra=[], output_median=24,
                                  max_output=256, requests_per_replica=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rate in args.rates:
            trace = long_prompt_trace(args.num_requests, rate, args.seed)
            path = write_jsonl_trace(work / f"trace-{rate:g}.jsonl", trace)
            for setup in args.setups:
                offline = disagg.slo_row(sim_args, rate, disagg.run_sim(sim_args, setup, rate, work))
                real = realtime(args, setup, path, work)
                rows.append({"setup": setup, "rate": rate, "offline": offline, "realtime": real})
                print(f"{setup:>4} @ {rate:g} req/s: attainment offline {offline['attainment']:.1%} / real time "
                      f"{real['attainment']:.1%}; TTFT p90 {offline['p90_ttft_s']:.2f} / {real['p90_ttft_s']:.2f} s; "
                      f"TPOT p90 {offline['p90_tpot_ms']:.1f} / {real['p90_tpot_ms']:.1f} ms; real-time hand-offs "
                      f"{real['num_handoffs']}, failed loads {real['num_failed_loads']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
