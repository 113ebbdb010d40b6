"""`stepahead bench`: serving benchmark against any running gateway.

    stepahead bench --target 127.0.0.1:50050 --scheduler 127.0.0.1:50051 \
        --num-prompts 64 --random-input-len 128 --random-output-len 64 --ignore-eos
    stepahead bench --dataset-name trace --dataset-path azure_conv.csv --trace-speedup 2 --num-prompts 500

Flags and result keys follow `vllm bench serve` (`output_throughput`, `median_ttft_ms`,
`p99_tpot_ms`, ...). Random prompts are seeded token ids; with `--request-rate inf` and
no `--max-concurrency` every request is sent at once, a finite rate draws Poisson arrivals.
A trace (`cli.datasets`: Azure CSV or JSONL) is replayed at its own arrival times
divided by `--trace-speedup`, with its lengths, priorities and prefix groups, EOS ignored.
Given `--scheduler`, also reports `device_utilization` (the device's busy seconds over the
wall time between two snapshots of the scheduler's counters, just before the first request
and just after the last answer, on a connection opened before the clock starts) and the
flight recorder's idle fraction.
"""

from __future__ import annotations

import asyncio
import argparse
import os
import sys
import json
import math
import random
import resource
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cli import output_file
from stepahead.config import Range


@dataclass
class RequestMetrics:
    prompt_len: int
    output_len: int = 0
    priority: int = 0
    start: float = 0.0
    first_token: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str = ""

    def on_message(self, msg) -> None:
        """One streamed GenerateResponse arrived now (once per token at stream interval 1:
        one clock read, one append, one access to the repeated field)."""
        n = len(msg.token_ids)
        if n:
            now = time.perf_counter()
            if not self.first_token:
                self.first_token = now
            self.token_times.append(now)
            self.output_len += n

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first_token) / (self.output_len - 1) if self.output_len > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class WorkItem:
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the run's start
    priority: int = 0


def sample_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def load_requests(args: argparse.Namespace):
    """The trace's requests with `--dataset-name trace` (a TraceError names what is wrong), else None."""
    if args.dataset_name != "trace":
        return None
    from cli.datasets import load_trace

    return load_trace(args.dataset_path, args.num_prompts, args.trace_speedup)


def make_workload(args: argparse.Namespace, vocab_size: int, trace=None) -> list[WorkItem]:
    """`trace`: `load_requests(args)` when the caller read it already."""
    if args.dataset_name == "trace":
        from cli.datasets import trace_prompts

        trace = trace if trace is not None else load_requests(args)
        prompts = trace_prompts(trace, vocab_size, args.seed)
        return [WorkItem(p, r.output_len, r.arrival_s, r.priority) for p, r in zip(prompts, trace)]
    rng = random.Random(args.seed)
    ins = sample_lengths(args.num_prompts, args.random_input_len, args.random_range_ratio, rng)
    outs = sample_lengths(args.num_prompts, args.random_output_len, args.random_range_ratio, rng)
    prompts = [[rng.randrange(5, vocab_size) for _ in range(i)] for i in ins]
    arrivals, t, arrival_rng = [], 0.0, random.Random(args.seed + 1)
    for _ in prompts:
        arrivals.append(t)
        if math.isfinite(args.request_rate):
            t += arrival_rng.expovariate(args.request_rate)  # Poisson arrivals: the workload itself
    return [WorkItem(p, o, a) for p, o, a in zip(prompts, outs, arrivals)]


def _request_of(item: WorkItem, ignore_eos: bool):
    from stepahead.v1 import common_pb2, generation_pb2

    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=ignore_eos)
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=item.prompt),
                                          sampling=sampling, priority=item.priority)


def error_text(exc: BaseException) -> str:
    """A failed request as the summary lists it: a gRPC status as `CODE: details`, else the repr."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"[:300]
    return repr(exc)[:200]


def one_request(stub, item: WorkItem, ignore_eos: bool) -> RequestMetrics:
    m = RequestMetrics(prompt_len=len(item.prompt), priority=item.priority)
    request = _request_of(item, ignore_eos)
    m.start = time.perf_counter()
    try:
        for msg in stub.Generate(request, timeout=3600):
            m.on_message(msg)
    except Exception as exc:  # recorded per request and reported, never hidden
        m.error = error_text(exc)
    m.end = time.perf_counter()
    return m


def run_workload(stub, workload: list[WorkItem], args: argparse.Namespace) -> tuple[list[RequestMetrics], float]:
    from tqdm import tqdm

    limit = threading.BoundedSemaphore(args.max_concurrency or len(workload))
    bar = tqdm(total=len(workload), desc="requests", unit="req", disable=args.disable_tqdm)
    ignore_eos = args.ignore_eos or args.dataset_name == "trace"

    def task(item: WorkItem) -> RequestMetrics:
        with limit:
            m = one_request(stub, item, ignore_eos)
        bar.update(1)
        return m

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(workload)) as pool:
        futures = []
        for item in workload:
            delay = t0 + item.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # the workload's arrival schedule
            futures.append(pool.submit(task, item))
        results = [f.result() for f in futures]
    elapsed = time.perf_counter() - t0
    bar.close()
    return results, elapsed


async def _one_request_async(stub, item: WorkItem, ignore_eos: bool, metadata) -> RequestMetrics:
    """`one_request` on a grpc.aio stub (same metrics)."""
    m = RequestMetrics(prompt_len=len(item.prompt), priority=item.priority)
    request = _request_of(item, ignore_eos)
    m.start = time.perf_counter()
    try:
        async for msg in stub.Generate(request, timeout=3600, metadata=metadata):
            m.on_message(msg)
    except Exception as exc:  # recorded per request and reported, never hidden
        m.error = error_text(exc)
    m.end = time.perf_counter()
    return m


async def run_workload_async(target: str, api_key: str | None, workload: list[WorkItem], args: argparse.Namespace,
                             snapshot: Callable[[], object] = lambda: None) -> tuple[list[RequestMetrics], float, tuple]:
    """The workload on one grpc.aio channel per gateway and one event loop: no thread per
    stream, so the client's own CPU per token stays small next to what it measures. `target`
    is one gateway address or a comma list of them (`targets`): request i goes to gateway
    i mod N. The channels are connected before the clock starts (a client's connection setup
    is not the server's time); `snapshot` is called just before the first request and just
    after the last answer, and both results are returned with the run's (results, seconds)."""
    import contextlib

    import grpc
    from tqdm import tqdm

    from stepahead.v1 import generation_pb2_grpc

    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    limit = asyncio.Semaphore(args.max_concurrency or len(workload))
    bar = tqdm(total=len(workload), desc="requests", unit="req", disable=args.disable_tqdm)
    ignore_eos = args.ignore_eos or args.dataset_name == "trace"
    async with contextlib.AsyncExitStack() as stack:
        channels = [await stack.enter_async_context(grpc.aio.insecure_channel(t)) for t in targets(target)]
        for channel in channels:
            await channel.channel_ready()
        stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in channels]

        async def task(i: int, item: WorkItem, start_at: float) -> RequestMetrics:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))  # the workload's arrival schedule
            async with limit:
                m = await _one_request_async(stubs[i % len(stubs)], item, ignore_eos, metadata)
            bar.update(1)
            return m

        before = snapshot()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(task(i, item, t0 + item.arrival_s) for i, item in enumerate(workload)))
        elapsed = time.perf_counter() - t0
        after = snapshot()
    bar.close()
    return list(results), elapsed, (before, after)


def targets(target: str) -> list[str]:
    """The gateway addresses of `--target` (one, or a comma list)."""
    addresses = [t.strip() for t in target.split(",")]
    if not all(addresses):
        raise SystemExit(f"--target {target!r}: an empty address in the comma list")
    return addresses


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def latency_stats(name: str, values_ms: list[float]) -> dict:
    """vLLM's keys: mean_/median_/std_/p99_<name>_ms."""
    return {
        f"mean_{name}_ms": statistics.fmean(values_ms) if values_ms else float("nan"),
        f"median_{name}_ms": percentile(values_ms, 50),
        f"std_{name}_ms": statistics.pstdev(values_ms) if values_ms else float("nan"),
        f"p99_{name}_ms": percentile(values_ms, 99),
    }


def summarize(results: list[RequestMetrics], elapsed: float) -> dict:
    ok = [r for r in results if not r.error]
    out_tokens, in_tokens = sum(r.output_len for r in ok), sum(r.prompt_len for r in ok)
    return {
        "duration": elapsed, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed, "output_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        **latency_stats("ttft", [r.ttft * 1e3 for r in ok if r.first_token]),
        **latency_stats("tpot", [r.tpot * 1e3 for r in ok if r.tpot is not None]),
        **latency_stats("itl", [x * 1e3 for r in ok for x in r.itls]),
        **latency_stats("e2el", [(r.end - r.start) * 1e3 for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


class DeviceCounters:
    """The scheduler's device counters over one channel kept open: a snapshot is one RPC, so
    the window they bound is the workload's, give or take a millisecond."""

    def __init__(self, scheduler: str, token: str | None) -> None:
        from stepahead import security
        from stepahead.v1 import scheduler_pb2_grpc

        self._channel = security.channel(scheduler, cluster_token=token)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def snapshot(self) -> tuple[float, float, int]:
        """(wall time, device busy seconds, tokens sampled)."""
        from stepahead.v1 import scheduler_pb2

        stats = self._stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=30)
        return time.time(), stats.device_busy_s, stats.num_sampled_tokens

    def close(self) -> None:
        self._channel.close()


def device_report(scheduler: str, window: tuple, token: str | None) -> dict:
    """Utilization = busy seconds / wall seconds between the two snapshots around the workload;
    the device's ideal = tokens / busy seconds."""
    from stepahead.flight_recorder import device_idle_fraction
    from cli.trace import fetch_records

    before, after = window
    wall, busy, tokens = after[0] - before[0], after[1] - before[1], after[2] - before[2]
    _, records = fetch_records(scheduler, token)
    inside = [r for r in records if r.worker.forward_start >= before[0] and r.worker.forward_end <= after[0]]
    return {
        "device_utilization": busy / wall if busy > 0 else None,  # None: the worker reports no busy time
        "device_busy_s": busy, "device_sampled_tokens": tokens,
        "device_ideal_output_throughput": tokens / busy if busy > 0 else None,
        "device_idle_fraction": device_idle_fraction(inside) if inside else None,
        "device_window": [before[0], after[0]],  # wall clock (time.time) of the two snapshots
    }


def plot(results: list[RequestMetrics], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    t0 = min(r.start for r in results)
    for i, r in enumerate(results):
        a.plot([t - t0 for t in r.token_times], [i] * len(r.token_times), ",", color="tab:blue")
        a.plot([r.start - t0], [i], "|", color="tab:red")
    a.set_xlabel("s")
    a.set_ylabel("request")
    a.set_title("token arrivals (red: sent)")
    tpot = [r.tpot * 1e3 for r in results if r.tpot is not None and not r.error]
    b.hist(tpot, bins=30)
    b.set_xlabel("TPOT ms")
    b.set_title("time per output token")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter  # every flag's help ends "(default: …)"
    parser.add_argument("--target", default="127.0.0.1:50050",
                        help="gateway address, or a comma list of them (requests spread round-robin)")
    parser.add_argument("--scheduler", default="", help="scheduler address, for device utilization")
    parser.add_argument("--cluster-token", default=os.environ.get("STEPAHEAD_CLUSTER_TOKEN"),
                        help="the scheduler's cluster token [env STEPAHEAD_CLUSTER_TOKEN]")
    parser.add_argument("--dataset-name", choices=["random", "trace"], default="random",
                        help="random token prompts, or a request trace (--dataset-path)")
    parser.add_argument("--dataset-path", type=Path, default=None, help="trace file (.csv Azure format, or .jsonl)")
    parser.add_argument("--trace-speedup", type=Range(float, 0, lo_open=True), default=1.0,
                        help="divide the trace's inter-arrival times")
    parser.add_argument("--num-prompts", type=Range(int, 1), default=64, help="requests (a trace: its first N)")
    parser.add_argument("--random-input-len", type=Range(int, 1), default=128, help="prompt tokens per random request")
    parser.add_argument("--random-output-len", type=Range(int, 1), default=64, help="output tokens per random request")
    parser.add_argument("--random-range-ratio", type=Range(float, 0, 1, hi_open=True), default=0.0,
                        help="lengths drawn from [len*(1-r), len*(1+r)]")
    parser.add_argument("--request-rate", type=Range(float, 0, lo_open=True, allow_inf=True), default=float("inf"),
                        help="requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=Range(int, 1), default=None,
                        help="most requests in flight (None: no cap)")
    parser.add_argument("--ignore-eos", action="store_true", help="(always on for a trace)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--label", default="stepahead", help="name in the results and the plot title")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--result-filename", type=Path, default=None, help="JSON results (and a .png beside it)")


def bench(args: argparse.Namespace) -> dict:
    """The API key (if the gateway wants one) comes from STEPAHEAD_API_KEY."""
    from stepahead import security
    from stepahead.v1 import generation_pb2, generation_pb2_grpc

    if args.dataset_name == "trace" and args.dataset_path is None:
        raise SystemExit("--dataset-name trace needs --dataset-path")
    trace = load_requests(args)  # a bad trace file fails before any call
    if args.result_filename:  # and so does a result file that cannot be written
        output_file(args.result_filename, "--result-filename")
    first, *others = targets(args.target)
    with security.channel(first, api_key=os.environ.get("STEPAHEAD_API_KEY")) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)
        workload = make_workload(args, info.vocab_size, trace)
        one_request(stub, WorkItem(workload[0].prompt[:8], 2), True)  # warm-up, not measured
        for other in others:
            with security.channel(other, api_key=os.environ.get("STEPAHEAD_API_KEY")) as warm:
                one_request(generation_pb2_grpc.GenerationStub(warm), WorkItem(workload[0].prompt[:8], 2), True)
        counters = DeviceCounters(args.scheduler, args.cluster_token) if args.scheduler else None
        cpu_start = _cpu_seconds()
        try:
            results, elapsed, window = asyncio.run(run_workload_async(
                args.target, os.environ.get("STEPAHEAD_API_KEY"), workload, args,
                counters.snapshot if counters else lambda: None))
        finally:
            if counters is not None:
                counters.close()
        client_cpu = _cpu_seconds() - cpu_start
    summary = {"label": args.label, "model": info.name, **summarize(results, elapsed),
               "client_cpu_s": client_cpu, "client_cpu_per_output_token_us":
               client_cpu / max(1, sum(r.output_len for r in results)) * 1e6}
    summary["config"] = {k: str(v) if isinstance(v, (Path, float)) else v for k, v in vars(args).items()
                         if k != "result_filename" and not callable(v)}
    if counters is not None:
        summary.update(device_report(args.scheduler, window, args.cluster_token))
    if args.result_filename:
        args.result_filename.write_text(json.dumps({**summary, "requests": [asdict(r) for r in results]}))
        plot(results, args.result_filename.with_suffix(".png"), f"{args.label} — {info.name}")
    return summary


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _row(name: str, value) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = "n/a" if value != value else f"{value:.2f}"  # NaN: no sample (e.g. no request got two tokens)
    else:
        shown = str(value)
    return f"{name:<40} {shown}"


def format_summary(summary: dict, result_filename: Path | None) -> str:
    """The summary as `vllm bench serve` prints it (same headings and rows, two decimals), then
    our extra rows and where the results went."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             _row("Label:", summary["label"]), _row("Model:", summary["model"]),
             _row("Successful requests:", summary["completed"]), _row("Failed requests:", summary["failed"]),
             _row("Benchmark duration (s):", summary["duration"]),
             _row("Total input tokens:", summary["total_input_tokens"]),
             _row("Total generated tokens:", summary["total_output_tokens"]),
             _row("Request throughput (req/s):", summary["request_throughput"]),
             _row("Output token throughput (tok/s):", summary["output_throughput"]),
             _row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for key, name, heading in (("ttft", "TTFT", "Time to First Token"),
                               ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                               ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=heading, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(_row(f"{label} {name} (ms):", summary[f"{stat}_{key}_ms"]))
    lines.append("{s:{c}^50}".format(s="Client and device", c="-"))
    lines.append(_row("Client CPU per output token (us):", summary["client_cpu_per_output_token_us"]))
    if "device_utilization" in summary:
        lines.append(_row("Device utilization:", summary["device_utilization"]))
        lines.append(_row("Device ideal output throughput (tok/s):", summary["device_ideal_output_throughput"]))
    lines.append("=" * 50)
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    if result_filename is not None:
        lines.append(f"results (JSON, every request): {result_filename}")
        lines.append(f"plot (token arrivals, TPOT histogram): {result_filename.with_suffix('.png')}")
    else:
        lines.append("results not saved (--result-filename FILE.json keeps them, with a plot beside it)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import grpc

    from cli import runfile

    if args.scheduler:  # a running `stepahead serve`'s run file gives its token
        args.scheduler, args.cluster_token = runfile.scheduler_access(args.scheduler, args.cluster_token)
    try:
        summary = bench(args)
    except grpc.RpcError as exc:
        hint = (" (the scheduler's cluster token: --cluster-token or STEPAHEAD_CLUSTER_TOKEN)"
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED else "")
        print(f"stepahead bench: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    print(format_summary(summary, args.result_filename))
    return 0 if summary["failed"] == 0 else 1
