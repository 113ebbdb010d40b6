"""Control-plane capacity against simulated accelerators: can scheduler + gateway + gRPC
keep an H200 busy, and up to how many streams? Built on `stepahead bench`.

    PYTHONPATH=. .venv/bin/python benchmarks/capacity.py \
        --setups h200:llama3-8b-sim h100x4:llama3-70b-sim --concurrency 32 64 128 256 512 1024 \
        --input-len 512 --output-len 256 --out benchmarks/results/capacity.json [--profile-cpu]

For each setup x concurrency, `stepahead serve --device sim` runs twice (async, then the
synchronous loop) with every request sent at once (`--max-concurrency` = streams). Reported:
device utilization (busy / wall, exact: the sim worker reports each step's busy time),
client-observed output tok/s vs the device's ideal (tokens / sum of step times), TTFT /
TPOT / ITL p50 / p99, CPU seconds of each process (scheduler, gateway, worker, this
client) from /proc, scheduler CPU per step (over the run, and while all N streams' requests
are running: the steps planned with N running, first to last, CPU sampled every 20 ms) and
gateway CPU per streamed token, the load
average and the machine's speed at the time (`python_speed_ms`: CPU ms of a fixed
pure-Python workload, measured before each run; on a shared VM it varies from minute to
minute). `--gateways N` starts N-1 gateways beside serve's on the same scheduler and the
bench alternates its streams between them; every process's CPU is also given in cores (CPU
seconds over the run's wall time), and the scheduler's CPU per step at full batch as a
fraction of the device's mean step then. With
`--profile-cpu`, py-spy samples the scheduler's and the gateway's GIL holders (the gateway's
largest leaf frames, in µs per streamed token), and splits the scheduler's CPU per step
into schedule, update, plan encode, result decode, event fan-out, stats/metrics and the
rest (gRPC and thread hand-offs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
from pathlib import Path

from benchmarks.machine import (CpuSampler, cpu_seconds, py_spy, python_speed_ms, python_thread_names,
                                thread_cpu_seconds)
from cli import bench
from model_zoo.builtin_models import resolve_model
from testing.launcher import ServeProcess
from testing.processes import spawn_gateway
from cli.trace import fetch_records
from stepahead.flight_recorder import StepRecord

# py-spy frame name fragments -> category of the scheduler's CPU (first match from the leaf up);
# py-spy names a frame "function (path:line)", so a method is matched by its name and file
CATEGORIES = {
    "plan encode": ("plan_to_proto",),
    "result decode": ("result_from_proto", "_read_results"),
    "event fan-out": ("event_batches", "add_event", "_dispatch", "GatewaySession", "Connect", "batches (scheduler_service/links.py"),
    "stats/metrics": ("stats (scheduler_service/core/scheduler.py", "build_stats", "SchedulerMetrics", "scheduler_service/metrics.py",
                      "_record (scheduler_service/replica.py", "prometheus"),
    "update": ("update_from_output",),
    "schedule": ("schedule (scheduler_service/core/scheduler.py",),
}


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def daemon_pids(serve: ServeProcess) -> dict[str, int]:
    out = {}
    for pid in serve.child_pids():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        for name in ("scheduler", "gateway", "worker"):
            if name.encode() in args:
                out[name] = pid
    return out


def bench_args(serve: ServeProcess, streams: int, args, label: str, targets: list[str] | None = None
               ) -> argparse.Namespace:
    """`stepahead bench` flags: every stream at once, to serve's gateway or to `targets`."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([
        "--target", ",".join(targets or [serve.gateway_addr]), "--scheduler", serve.scheduler_addr, f"--cluster-token={serve.cluster_token}", "--num-prompts", str(streams),
        "--max-concurrency", str(streams), "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm", "--label", label,
    ])


def all_running_cpu(records: list[StepRecord], streams: int, samplers: dict[str, CpuSampler]) -> dict:
    """The scheduler's CPU per step while every stream's request is in the batch (the steps
    planned with `streams` running, from the first to the last: the decode phase at full
    batch, without the ramp of admissions before it or the drain after); beside it, over the
    same steps, the device's idle time per step (the wall between two steps' ends less the
    step's busy time) and, for the scheduler and the worker (the two processes each step
    waits on), their CPU and their threads' run-queue wait per step: the time they were
    ready to run and no CPU was free."""
    empty = {"all_running_steps": 0, "scheduler_cpu_per_step_ms_all_running": None,
             "device_step_ms_all_running": None, "scheduler_cpu_over_device_step": None,
             "device_idle_per_step_ms_all_running": None, "per_step_ms_all_running": None}
    full = sorted(r.schedule_start for r in records if r.num_running == streams)
    if len(full) < 2:
        return empty
    inside = [r for r in records if full[0] <= r.schedule_start < full[-1]]
    per_step = {}
    for name, sampler in samplers.items():
        for what, value in (("cpu", sampler.cpu_between(full[0], full[-1])),
                            ("runqueue_wait", sampler.wait_between(full[0], full[-1]))):
            per_step[f"{name}_{what}"] = None if value is None else value / len(inside) * 1e3
    device_step = sum(r.worker.device_busy_s for r in inside) / len(inside)  # the device's mean step
    by_id = {r.step_id: r for r in records}
    gaps = [r.worker.forward_end - by_id[r.step_id - 1].worker.forward_end - r.worker.device_busy_s
            for r in inside if r.step_id - 1 in by_id and r.worker.forward_end and by_id[r.step_id - 1].worker.forward_end]
    cpu = per_step.get("scheduler_cpu")
    return {"all_running_steps": len(inside),
            "scheduler_cpu_per_step_ms_all_running": cpu,
            "device_step_ms_all_running": device_step * 1e3,
            # < 1: one scheduler core plans faster than the device steps (the budget: 0.4)
            "scheduler_cpu_over_device_step": None if cpu is None or not device_step else cpu / 1e3 / device_step,
            "device_idle_per_step_ms_all_running": sum(gaps) / len(gaps) * 1e3 if gaps else None,
            # {scheduler,worker}_{cpu,runqueue_wait}: ms per step over the same steps
            "per_step_ms_all_running": per_step}


def phase_totals(records: list[StepRecord], streams: int, since: float = 0.0) -> dict[str, list]:
    """[busy s, wall s, steps] of the decode phase (steps of at most one token per stream) and
    of the steps carrying prefill chunks, from the flight record: each step's busy time and the
    wall time since the previous step ended; steps after `since` (wall clock) only."""
    by_id = {r.step_id: r for r in records}
    phases = {"decode": [0.0, 0.0, 0], "prefill": [0.0, 0.0, 0]}
    for r in records:
        prev = by_id.get(r.step_id - 1)
        if prev is None or not (r.worker.forward_start and prev.worker.forward_end) or prev.worker.forward_end < since:
            continue
        phase = phases["decode" if r.num_tokens <= streams else "prefill"]
        phase[0] += r.worker.device_busy_s
        phase[1] += r.worker.forward_end - prev.worker.forward_end
        phase[2] += 1
    return phases


def phase_utilization(records: list[StepRecord], streams: int, since: float = 0.0) -> dict[str, float | None]:
    return {k: busy / wall if wall else None for k, (busy, wall, _) in phase_totals(records, streams, since).items()}


def split_profile(path: Path) -> dict[str, float]:
    """Fraction of GIL-holding samples per category."""
    counts: collections.Counter = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():  # a line py-spy garbled (it read the process while it changed)
            continue
        frames = stack.split(";")[::-1]
        counts[next((c for f in frames for c, keys in CATEGORIES.items() if any(k in f for k in keys)),
                    "gRPC, threads, other")] += int(n)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.items()}


def run_one(args, setup: str, model: str, streams: int, async_on: bool) -> dict:
    profile, _, devices = setup.partition("x")
    window = args.max_concurrent_batches if async_on else 1
    adaptive = async_on and args.adaptive_concurrent_batches
    label = f"{setup}-{model}-{streams}-{'async' if async_on else 'sync'}" + (
        f"-si{args.stream_interval}" if args.stream_interval > 1 else "") + (
        f"-w{window}" if async_on and window != 3 else "") + ("-fixed" if async_on and not adaptive else "")
    loop = (["--async-scheduling", "--max-concurrent-batches", str(window),
             "--adaptive-concurrent-batches" if adaptive else "--no-adaptive-concurrent-batches"]
            if async_on else ["--no-async-scheduling"])
    flags = ["--device", "sim", "--sim-profile", profile, "--sim-num-devices", devices or "1",
             "--max-num-seqs", str(max(streams, 1)), *loop, "--stream-interval", str(args.stream_interval)]
    speed = python_speed_ms()
    with contextlib.ExitStack() as stack:
        serve = stack.enter_context(ServeProcess(model, *flags))
        pids = daemon_pids(serve)
        targets = [serve.gateway_addr]
        for i in range(1, args.gateways):  # the gateways past serve's own, stopped however the run ends
            proc, address = spawn_gateway(serve.scheduler_addr, str(resolve_model(model)), serve.cluster_token,
                                          "--stream-interval", str(args.stream_interval))
            stack.callback(_stop, proc)
            pids[f"gateway{i}"], targets = proc.pid, [*targets, address]
        steps0 = serve.stats().num_steps
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        threads0 = thread_cpu_seconds(pids["scheduler"])
        spies = {}
        if args.profile_cpu:
            for name in ("scheduler", "gateway"):
                out = args.out.parent / f"capacity_profile_{label}{'' if name == 'scheduler' else '_gateway'}.txt"
                spies[name] = subprocess.Popen([str(py_spy()), "record", "-p", str(pids[name]), "-o", str(out), "-f",
                                                "raw", "--gil", "--nonblocking", "-r", "250"],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samplers = {name: CpuSampler(pids[name]) for name in ("scheduler", "worker")}
        summary = bench.bench(bench_args(serve, streams, args, label, targets))
        cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
        for sampler in samplers.values():
            sampler.stop()
        steps = serve.stats().num_steps - steps0
        _, records = fetch_records(serve.scheduler_addr, serve.cluster_token)
        threads = scheduler_threads(pids["scheduler"], threads0, steps)
        for spy in spies.values():
            spy.send_signal(2)  # SIGINT: py-spy writes its samples and exits
            spy.wait(60)
    row = {k: summary.get(k) for k in (
        "label", "completed", "failed", "duration", "total_output_tokens", "output_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
        "device_utilization", "device_busy_s", "device_ideal_output_throughput", "client_cpu_s", "errors")}
    ideal = row["device_ideal_output_throughput"] or float("nan")
    gateway_cpu = sum(v for k, v in cpu.items() if k.startswith("gateway"))
    row.update(setup=setup, model=model, streams=streams, mode="async" if async_on else "sync", steps=steps,
               stream_interval=args.stream_interval, gateways=args.gateways, max_concurrent_batches=window,
               adaptive_concurrent_batches=adaptive,
               client_vs_ideal=row["output_throughput"] / ideal,
               cpu_s=cpu, cpu_cores={k: v / row["duration"] for k, v in {**cpu, "client": row["client_cpu_s"]}.items()},
               scheduler_cpu_per_step_ms=cpu["scheduler"] / max(steps, 1) * 1e3,
               gateway_cpu_per_token_us=gateway_cpu / max(row["total_output_tokens"], 1) * 1e6,
               load_average=os.getloadavg()[0], scheduler_thread_cpu_ms_per_step=threads, python_speed_ms=speed,
               device_utilization_by_phase=phase_utilization(records, streams, (summary.get("device_window") or [0])[0]),
               **all_running_cpu(records, streams, samplers))
    if spies:
        split = split_profile(args.out.parent / f"capacity_profile_{label}.txt")
        row["scheduler_cpu_split_ms_per_step"] = {k: v * row["scheduler_cpu_per_step_ms"] for k, v in split.items()}
        row["gateway_top_self_us_per_token"] = {
            k: v * row["gateway_cpu_per_token_us"]
            for k, v in top_frames(args.out.parent / f"capacity_profile_{label}_gateway.txt").items()}
    return row


def scheduler_threads(pid: int, before: dict[int, tuple[str, float]], steps: int) -> dict[str, float]:
    """The scheduler's CPU per step by thread (ms), Python threads by their name (`py-spy dump`;
    Python 3.11 does not name OS threads), grpc core's by their OS name; threads of one role
    summed (grpc's handler pool threads run the stream writers and readers)."""
    names = python_thread_names(pid)
    out: collections.Counter = collections.Counter()
    for tid, (comm, seconds) in thread_cpu_seconds(pid).items():
        name = names.get(tid, f"{comm} (native)")
        out[re.sub(r"_\d+$|-\d+$", "", name)] += seconds - before.get(tid, (comm, 0.0))[1]
    return {k: v / max(steps, 1) * 1e3 for k, v in out.most_common() if v > 0}


def top_frames(path: Path, n: int = 12) -> dict[str, float]:
    """Fraction of GIL-holding samples per leaf frame (function and file), the n largest."""
    counts: collections.Counter = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, k = line.rpartition(" ")
        if k.isdigit():
            counts[stack.split(";")[-1]] += int(k)
    total = sum(counts.values()) or 1
    return {frame: c / total for frame, c in counts.most_common(n)}


def table(rows: list[dict]) -> str:
    head = ("| setup | streams | mode | util | tok/s | ideal tok/s | client/ideal | TTFT p50/p99 ms | "
            "TPOT p50/p99 ms | ITL p50/p99 ms | sched CPU/step ms: run / all running | gw CPU/token µs | client CPU s | "
            "load | py ms |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['setup']} {r['model']} | {r['streams']} | {r['mode']} | {r['device_utilization']:.1%} | "
            f"{r['output_throughput']:.0f} | {r['device_ideal_output_throughput']:.0f} | {r['client_vs_ideal']:.0%} | "
            f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | "
            f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['scheduler_cpu_per_step_ms']:.2f} / "
            f"{_ms(r.get('scheduler_cpu_per_step_ms_all_running'))} | "
            f"{r['gateway_cpu_per_token_us']:.0f} | {r['client_cpu_s']:.1f} | {r['load_average']:.1f} | "
            f"{r.get('python_speed_ms', float('nan')):.0f} |")
    return "\n".join(lines)


def cpu_line(r: dict) -> str:
    """Every process's CPU over the run in cores (1.0: one core busy), and the scheduler's CPU
    per step at full batch beside the device's step."""
    cores = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items())
    return (f"CPU cores: {cores}; scheduler CPU per step at full batch {_ms(r['scheduler_cpu_per_step_ms_all_running'])}"
            f" ms = {_pct(r['scheduler_cpu_over_device_step'])} of the {_ms(r['device_step_ms_all_running'])} ms "
            f"device step{_waits(r)}")


def _waits(r: dict) -> str:
    """Where the device's idle time per step at full batch went: the scheduler's and the
    worker's CPU and run-queue wait per step over the same steps."""
    per_step = r.get("per_step_ms_all_running")
    if not per_step or r.get("device_idle_per_step_ms_all_running") is None:
        return ""
    return (f"; per step at full batch: device idle {_ms(r['device_idle_per_step_ms_all_running'])} ms, "
            f"scheduler CPU {_ms(per_step.get('scheduler_cpu'))} + waiting for a CPU "
            f"{_ms(per_step.get('scheduler_runqueue_wait'))} ms, worker CPU {_ms(per_step.get('worker_cpu'))} + "
            f"waiting {_ms(per_step.get('worker_runqueue_wait'))} ms")


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (setup, model, mode), group in _groups(rows).items():
        xs = [r["streams"] for r in group]
        style = "-o" if mode == "async" else "--s"
        a.plot(xs, [r["device_utilization"] for r in group], style, label=f"{setup} {model} {mode}")
        b.plot(xs, [r["output_throughput"] for r in group], style, label=f"{setup} {model} {mode}")
        if mode == "async":
            b.plot(xs, [r["device_ideal_output_throughput"] for r in group], ":", color="gray",
                   label=f"{setup} device ideal")
    for ax, title in ((a, "device utilization"), (b, "client-observed output tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend(fontsize=7)
    a.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _groups(rows):
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(r["setup"], r["model"], r["mode"])].append(r)
    return {k: sorted(v, key=lambda r: r["streams"]) for k, v in groups.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=["h200:llama3-8b-sim"],
                        help="PROFILE[xDEVICES]:MODEL, e.g. h200:llama3-8b-sim h100x4:llama3-70b-sim "
                             "h200:qwen3-30b-a3b-sim h200x2:mixtral-8x7b-sim (MoE)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    parser.add_argument("--stream-interval", type=int, default=1, help="the gateway's --stream-interval")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateways (serve's and N-1 more on the same scheduler); the bench's streams "
                             "alternate between them")
    parser.add_argument("--max-concurrent-batches", type=int, default=3,
                        help="the scheduler's most plans in flight in async mode (its default: 3)")
    parser.add_argument("--adaptive-concurrent-batches", action=argparse.BooleanOptionalAction, default=True,
                        help="one step ahead, deeper only while the device waits (the scheduler's default); "
                             "--no-adaptive-concurrent-batches: always --max-concurrent-batches")
    parser.add_argument("--profile-cpu", action="store_true", help="py-spy the scheduler (needs py-spy in the venv)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/capacity.json"))
    args = parser.parse_args()
    if args.gateways < 1:
        parser.error(f"--gateways must be >= 1, got {args.gateways}")
    if args.profile_cpu and py_spy() is None:
        parser.error("--profile-cpu needs py-spy beside this interpreter: pip install py-spy into the venv")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for setup_model in args.setups:
        setup, _, model = setup_model.partition(":")
        for streams in args.concurrency:
            for mode in args.modes:
                rows.append(run_one(args, setup, model, streams, mode == "async"))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                print("  " + cpu_line(rows[-1]), flush=True)
                args.out.write_text(json.dumps({"rows": rows, "input_len": args.input_len,
                                                "output_len": args.output_len, "cpus": os.cpu_count()}, indent=2))
    print(table(rows))
    for r in rows:
        print(f"{r['label']}: {cpu_line(r)}")
    for (setup, model, _), group in _groups(rows).items():
        sync = {r["streams"]: r for r in rows if (r["setup"], r["model"], r["mode"]) == (setup, model, "sync")}
        for r in group:
            if r["mode"] == "async" and r["streams"] in sync:
                r["async_over_sync"] = r["output_throughput"] / sync[r["streams"]]["output_throughput"]
                phases = {k: (r["device_utilization_by_phase"][k], sync[r["streams"]]["device_utilization_by_phase"][k])
                          for k in ("decode", "prefill")}
                print(f"{setup} {model} {r['streams']} streams: async/sync tok/s = {r['async_over_sync']:.2f}; util "
                      + ", ".join(f"{k} phase {_pct(a)} / {_pct(b)}" for k, (a, b) in phases.items()))
    args.out.write_text(json.dumps({"rows": rows, "input_len": args.input_len, "output_len": args.output_len,
                                    "cpus": os.cpu_count()}, indent=2))
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
