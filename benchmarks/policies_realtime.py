"""The scheduling policies' real-time confirmation: `benchmarks/policies.py`'s traces through
the real daemons (`stepahead serve --device sim` + `stepahead bench --dataset-name trace`),
side by side with the offline simulator's prediction of the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/policies_realtime.py --slowdown 16 --num-requests 200 \
        --policies score priority --out benchmarks/results/policies_realtime.json

An H100 at full speed serves these traces faster than a small machine's control plane and
client can stream (docs/benchmarks.md). So time is dilated: the device is K times
slower (memory bandwidth, FLOP/s and host link / K, step overhead x K: every step takes
exactly K times as long), the trace's arrivals are K times further apart and the aging
bound and the score policy's TTFT target are K times longer. The schedule is then the same
as at full speed, in K-times-longer time; latencies are reported divided by K, comparable
with `policies.json`. Per policy and load (0.5x and 1.5x the capacity): priority-0 TTFT
p50/p99 offline and real-time, and the goal (priority-0 p99 TTFT at 1.5x <= 2x its value at
0.5x) judged on each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from benchmarks import policies
from cli import bench
from testing.launcher import ServeProcess
from worker_service.sim.profiles import load_profile

LOADS = (0.5, 1.5)


def slowed_profile(name: str, k: float, directory: Path) -> Path:
    p = load_profile(name)
    slow = dataclasses.replace(p, name=f"{name}-slow{k:g}", memory_bandwidth=p.memory_bandwidth / k,
                               peak_flops=p.peak_flops / k, host_link_bandwidth=p.host_link_bandwidth / k,
                               step_overhead_s=p.step_overhead_s * k)
    path = directory / f"{slow.name}.json"
    path.write_text(json.dumps(dataclasses.asdict(slow)))
    return path


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def realtime(args, trace: Path, profile: Path, policy: str, work: Path) -> dict:
    flags = ["--device", "sim", "--sim-profile", str(profile), "--scheduling-policy", policy,
             "--max-num-seqs", str(args.max_num_seqs), "--max-wait-time", str(args.max_wait_time * args.slowdown),
             "--score-ttft-target", str(policies.TTFT_SLO_S * args.slowdown)]
    result_file = work / f"rt-{policy}-{trace.stem}.json"
    with ServeProcess(args.model, *flags) as serve:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        ns = parser.parse_args(["--target", serve.gateway_addr, "--scheduler", serve.scheduler_addr,
                                f"--cluster-token={serve.cluster_token}", "--dataset-name", "trace",
                                "--dataset-path", str(trace), "--disable-tqdm", "--num-prompts", str(args.num_requests),
                                "--result-filename", str(result_file)])
        summary = bench.bench(ns)
    requests = json.loads(result_file.read_text())["requests"]
    classes = {}
    for prio in ("0", "1", "2"):
        ttft = [(r["first_token"] - r["start"]) * 1e3 / args.slowdown for r in requests
                if str(r["priority"]) == prio and r["first_token"] and not r["error"]]
        classes[prio] = {"median_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
                         "num_requests": len(ttft)}
    return {"classes": classes, "failed": sum(1 for r in requests if r["error"]),
            "device_utilization": summary.get("device_utilization"), "output_throughput": summary["output_throughput"]}


def offline(args, trace: Path, profile: Path, policy: str) -> dict:
    sim_args = argparse.Namespace(model=args.model, sim_profile=str(profile), max_num_seqs=args.max_num_seqs,
                                  max_wait_time=args.max_wait_time * args.slowdown,
                                  score_ttft_target=policies.TTFT_SLO_S * args.slowdown, extra=[])
    result = policies.run_sim(sim_args, trace, policy)
    return {"classes": {p: {"median_ttft_ms": v["median_ttft_ms"] / args.slowdown,
                            "p99_ttft_ms": v["p99_ttft_ms"] / args.slowdown, "num_requests": v["num_requests"]}
                        for p, v in result["by_priority"].items()},
            "output_throughput": result["output_throughput"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sim-profile", default="h100")
    parser.add_argument("--model", default="llama3-8b-sim")
    parser.add_argument("--slowdown", type=float, default=16.0, help="K: device and trace K times slower")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--capacity-requests", type=int, default=1500, help="burst size that measures capacity")
    parser.add_argument("--policies", nargs="+", default=["score", "priority"], choices=policies.POLICIES)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-wait-time", type=float, default=30.0, help="aging bound at full speed (x K)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/policies_realtime.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="policies-rt-") as tmp:
        work = Path(tmp)
        profile = slowed_profile(args.sim_profile, args.slowdown, work)
        burst = policies.poisson_trace(work / "burst.jsonl", args.capacity_requests, float("inf"), args.seed,
                                      args.prompt_len, args.output_len)
        sim_args = argparse.Namespace(model=args.model, sim_profile=str(profile), max_num_seqs=args.max_num_seqs,
                                      max_wait_time=args.max_wait_time * args.slowdown,
                                      score_ttft_target=policies.TTFT_SLO_S * args.slowdown, extra=[])
        capacity = policies.steady_rate(policies.run_sim(sim_args, burst, "fcfs")["requests"])
        print(f"capacity of the {args.slowdown:g}x slower device: {capacity:.3f} requests/s "
              f"({capacity * args.slowdown:.2f} at full speed)", flush=True)
        for load in LOADS:
            trace = policies.poisson_trace(work / f"load{load}.jsonl", args.num_requests, load * capacity, args.seed,
                                          args.prompt_len, args.output_len)
            for policy in args.policies:
                row = {"load": load, "policy": policy, "offline": offline(args, trace, profile, policy),
                       "realtime": realtime(args, trace, profile, policy, work)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    verdicts = goals(rows, args.policies)
    print("\n".join(verdicts))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"capacity_req_s_slowed": capacity, "rows": rows, "goals": verdicts,
                                    "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))


def goals(rows: list[dict], names: list[str]) -> list[str]:
    by = {(r["load"], r["policy"]): r for r in rows}
    out = []
    for policy in names:
        for side in ("offline", "realtime"):
            lo = by[(0.5, policy)][side]["classes"]["0"]["p99_ttft_ms"]
            hi = by[(1.5, policy)][side]["classes"]["0"]["p99_ttft_ms"]
            out.append(f"{policy} {side}: priority-0 p99 TTFT at 1.5x = {hi:.0f} ms vs 2 x {lo:.0f} ms at 0.5x: "
                       f"{'holds' if hi <= 2 * lo else 'MISSED'}")
    return out


if __name__ == "__main__":
    main()
