"""Overload traces and their quality measures, shared by `benchmarks/policies.py` (which
documents them) and the sim tests of its goals (`tests/sim/test_overload_goals.py`): the
Azure LLM inference trace's two services, replayed from the rows that ship in
`benchmarks/data/azure_llm_2023/` (`AZURE_TRACES`, `azure_rows`) or generated from their
published shapes (`SHAPES`, `bursty_rows`), priority classes, `stepahead simulate` runs under a
policy (`run_sim`), and one run's row (`quality`: per-class TTFT / TPOT tails, waits past the
aging bound, shed requests, goodput)."""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from cli import simulate
from cli.bench import percentile
from scheduler_service.server import SchedulerDaemonConfig
from stepahead import config as cfg

CLASSES = ((0, 0.1), (1, 0.3), (2, 0.6))
POLICIES = ("fcfs", "priority", "score")
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.1

# The first rows of the Azure LLM inference trace 2023 (CC-BY 4.0; README beside them).
_DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "azure_llm_2023"
AZURE_TRACES = {"conv": _DATA / "AzureLLMInferenceTrace_conv_head.csv",
                "code": _DATA / "AzureLLMInferenceTrace_code_head.csv"}


@dataclass(frozen=True)
class Shape:
    """A service's request lengths: log-normal prompt and output lengths (median, sigma),
    clipped to [1, max_prompt] and [1, max_output]."""

    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    max_prompt: int = 7000
    max_output: int = 1000


# The Azure LLM inference trace 2023's two services, by their published medians (spreads chosen
# to give their heavy tails): a stand-in generated from the shape, not the trace itself.
SHAPES = {"conv": Shape(1020, 0.65, 150, 0.95), "code": Shape(1500, 0.8, 13, 1.2)}


def bursty_rows(rng: random.Random, n: int, rate: float, shape: Shape, cv: float = 2.5, ratio: float = 4.0,
                phase_s: float = 20.0) -> list[dict]:
    """`n` requests at mean `rate` in bursts: Gamma gaps of coefficient of variation `cv`, the
    rate `ratio` times higher in busy phases than in calm ones (phases of exponential length,
    mean `phase_s`, as much time busy as calm); lengths of `shape`; priority classes `CLASSES`."""
    gamma, busy, calm = 1 / cv**2, 2 * ratio / (ratio + 1), 2 / (ratio + 1)
    t, state, switch, rows = 0.0, 0, rng.expovariate(1 / phase_s), []
    for _ in range(n):
        if rate != float("inf"):
            t += rng.gammavariate(gamma, 1 / (gamma * rate * (busy if state else calm)))
        while t > switch:
            state, switch = state ^ 1, switch + rng.expovariate(1 / phase_s)
        p = min(shape.max_prompt, max(1, int(rng.lognormvariate(math.log(shape.prompt_median), shape.prompt_sigma))))
        o = min(shape.max_output, max(1, int(rng.lognormvariate(math.log(shape.output_median), shape.output_sigma))))
        rows.append({"arrival_s": t, "prompt_len": p, "output_len": o, "priority": _priority(rng)})
    return rows


def azure_rows(path: Path, n: int, rate: float, seed: int) -> list[dict]:
    """The first `n` requests of an Azure trace CSV with their real lengths and their real
    inter-arrival times, scaled to mean `rate` (inf: all at once); a priority class drawn per
    request."""
    from cli.datasets import load_trace

    trace, rng = load_trace(path, n), random.Random(seed)
    if len(trace) < n:
        raise ValueError(f"{path} holds {len(trace)} requests, {n} asked for")
    span = trace[-1].arrival_s
    scale = 0.0 if rate == float("inf") or span == 0 else (len(trace) - 1) / rate / span
    return [{"arrival_s": r.arrival_s * scale, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "priority": _priority(rng)} for r in trace]


def _priority(rng: random.Random) -> int:
    return rng.choices([c for c, _ in CLASSES], [w for _, w in CLASSES])[0]


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def sim_flags(args, policy: str) -> list[str]:
    flags = ["--model", args.model, "--sim-profile", args.sim_profile, "--scheduling-policy", policy,
             "--max-num-seqs", str(args.max_num_seqs), "--max-wait-time", str(args.max_wait_time),
             "--score-ttft-target", str(args.score_ttft_target)]
    if getattr(args, "max_expected_wait", None) is not None:
        flags += ["--max-expected-wait", str(args.max_expected_wait)]
    if getattr(args, "preemption_min_progress", None) is not None:
        flags += ["--preemption-min-progress", str(args.preemption_min_progress)]
    return flags + list(args.extra)


def run_sim(args, trace: Path, policy: str) -> dict:
    """`stepahead simulate` on `trace` with `args`' flags (`sim_flags`) under `policy`."""
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    ns = parser.parse_args(["--dataset-path", str(trace), *sim_flags(args, policy)])
    return simulate.simulate(cfg.from_args(simulate.SimulateConfig, ns), cfg.from_args(SchedulerDaemonConfig, ns))


def _ttft(r: dict) -> float:
    return r["token_times"][0] - r["arrival"]


def _tpot(r: dict) -> float | None:
    times = r["token_times"]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def _tails(reqs: list[dict]) -> dict:
    served = [r for r in reqs if r["token_times"]]
    ttft = [_ttft(r) * 1e3 for r in served]
    tpot = [t * 1e3 for r in served if (t := _tpot(r)) is not None]
    return {"num_requests": len(reqs), "num_shed": sum(not r["token_times"] for r in reqs),
            "median_ttft_ms": percentile(ttft, 50), "p99_ttft_ms": percentile(ttft, 99),
            "p99_tpot_ms": percentile(tpot, 99)}


SHED_QUEUED = "not admitted within --max-wait-time"  # the refusal of a request shed after queueing


def quality(result: dict, max_wait: float) -> dict:
    """The row of one run: `result["requests"]` holds every offered request, shed ones with
    no token (`finish_reason` REJECTED: ..., at arrival or, `num_shed_queued`, after queueing)."""
    reqs = result["requests"]
    served = [r for r in reqs if r["token_times"]]
    unfinished = [r for r in reqs if not r["finish_reason"]]
    assert not unfinished, f"{len(unfinished)} requests never finished"
    good = sum(_ttft(r) <= TTFT_SLO_S and (_tpot(r) or 0.0) <= TPOT_SLO_S for r in served)
    waits = [r["first_scheduled"] - r["arrival"] for r in served]
    preemptions = [r["num_preemptions"] for r in served]
    return {
        "goodput": good / len(reqs), "max_queue_wait_s": max(waits), "aging_bound_s": max_wait,
        "waits_over_bound": sum(w > max_wait for w in waits), "num_shed": len(reqs) - len(served),
        "num_shed_queued": sum(SHED_QUEUED in r["finish_reason"] for r in reqs),
        "num_preemptions": result["num_preemptions"], "preemptions_per_request": sum(preemptions) / len(reqs),
        "max_preemptions_per_request": max(preemptions), "output_throughput": result["output_throughput"],
        "all": _tails(reqs),
        "classes": {str(p): _tails([r for r in reqs if r["priority"] == p]) for p, _ in CLASSES},
    }
