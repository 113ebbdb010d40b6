"""`stepahead bench`: serving benchmark against any running gateway.

    stepahead bench --target 127.0.0.1:50050 --scheduler 127.0.0.1:50051 \
        --num-prompts 64 --random-input-len 128 --random-output-len 64 --ignore-eos

Flags follow `vllm bench serve`. Prompts are random token ids (seeded). With
`--request-rate inf` and no `--max-concurrency` every request is sent at once (closed-loop
saturation); a finite rate draws Poisson arrivals. Reports output tokens/s, TTFT and TPOT
percentiles and, given `--scheduler`, the device idle fraction from the flight recorder.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RequestMetrics:
    prompt_len: int
    output_len: int = 0
    start: float = 0.0
    first_token: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first_token) / (self.output_len - 1) if self.output_len > 1 else None


def sample_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    ins = sample_lengths(args.num_prompts, args.random_input_len, args.random_range_ratio, rng)
    outs = sample_lengths(args.num_prompts, args.random_output_len, args.random_range_ratio, rng)
    return [([rng.randrange(5, vocab_size) for _ in range(i)], o) for i, o in zip(ins, outs)]


def one_request(stub, prompt: list[int], max_tokens: int, ignore_eos: bool) -> RequestMetrics:
    from stepahead.v1 import common_pb2, generation_pb2

    m = RequestMetrics(prompt_len=len(prompt))
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling)
    m.start = time.perf_counter()
    try:
        for msg in stub.Generate(request, timeout=3600):
            now = time.perf_counter()
            if msg.token_ids:
                if not m.first_token:
                    m.first_token = now
                m.token_times.append(now)
                m.output_len += len(msg.token_ids)
    except Exception as exc:  # recorded per request and reported, never hidden
        m.error = repr(exc)[:200]
    m.end = time.perf_counter()
    return m


def run_workload(stub, workload, args: argparse.Namespace) -> tuple[list[RequestMetrics], float, float, float]:
    from tqdm import tqdm

    rng = random.Random(args.seed + 1)
    limit = threading.BoundedSemaphore(args.max_concurrency or len(workload))
    bar = tqdm(total=len(workload), desc="requests", unit="req")

    def task(prompt, max_tokens):
        with limit:
            m = one_request(stub, prompt, max_tokens, args.ignore_eos)
        bar.update(1)
        return m

    wall_start, t0 = time.time(), time.perf_counter()
    with ThreadPoolExecutor(len(workload)) as pool:
        futures = []
        for prompt, max_tokens in workload:
            futures.append(pool.submit(task, prompt, max_tokens))
            if math.isfinite(args.request_rate):
                time.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals: the workload itself
        results = [f.result() for f in futures]
    elapsed = time.perf_counter() - t0
    bar.close()
    return results, elapsed, wall_start, time.time()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[RequestMetrics], elapsed: float) -> dict:
    ok = [r for r in results if not r.error]
    ttft = [r.ttft * 1e3 for r in ok if r.first_token]
    tpot = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    out_tokens = sum(r.output_len for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": elapsed,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / elapsed, "request_throughput_req_s": len(ok) / elapsed,
        "mean_ttft_ms": statistics.fmean(ttft) if ttft else float("nan"),
        "p50_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
        "mean_tpot_ms": statistics.fmean(tpot) if tpot else float("nan"),
        "p50_tpot_ms": percentile(tpot, 50), "p99_tpot_ms": percentile(tpot, 99),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def device_idle(scheduler: str, start: float, end: float) -> float | None:
    from stepahead.flight_recorder import device_idle_fraction
    from stepahead.trace import fetch_records

    _, records = fetch_records(scheduler)
    inside = [r for r in records if r.worker.forward_start >= start and r.worker.forward_end <= end]
    if not inside:
        return None
    return device_idle_fraction(inside)  # over the span of the recorded steps


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
    parser.add_argument("--target", default="127.0.0.1:50050", help="gateway address")
    parser.add_argument("--scheduler", default="", help="scheduler address, for the device idle fraction")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="stepahead")
    parser.add_argument("--result-filename", type=Path, default=None, help="JSON results (and a .png beside it)")


def bench(args: argparse.Namespace) -> dict:
    """The API key (if the gateway wants one) comes from STEPAHEAD_API_KEY."""
    import os

    from stepahead import security
    from stepahead.v1 import generation_pb2, generation_pb2_grpc

    with security.channel(args.target, api_key=os.environ.get("STEPAHEAD_API_KEY")) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)
        workload = make_workload(args, info.vocab_size)
        one_request(stub, workload[0][0][:8], 2, True)  # warm-up, not measured
        results, elapsed, wall_start, wall_end = run_workload(stub, workload, args)
    summary = {"label": args.label, "model": info.name, **summarize(results, elapsed)}
    summary["config"] = {k: v for k, v in vars(args).items() if k != "result_filename" and not callable(v)}
    summary["config"]["request_rate"] = str(args.request_rate)
    if args.scheduler:
        summary["device_idle_fraction"] = device_idle(args.scheduler, wall_start, wall_end)
    if args.result_filename:
        args.result_filename.parent.mkdir(parents=True, exist_ok=True)
        args.result_filename.write_text(json.dumps({**summary, "requests": [asdict(r) for r in results]}))
        plot(results, args.result_filename.with_suffix(".png"), f"{args.label} — {info.name}")
    return summary


def run(args: argparse.Namespace) -> int:
    summary = bench(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    return 0 if summary["failed"] == 0 else 1
