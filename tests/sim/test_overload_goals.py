"""Issue 37's goals on short slices of both production trace shapes (conversation and code),
through the deterministic offline simulator, as `benchmarks/policies.py` measures them: the
score policy at 1.5x its capacity keeps priority 0's p99 TTFT and the TPOT p99 within 2x
their values at 0.5x, no request waits in the queue past the aging bound (overload is shed
instead), its goodput is at least fcfs's and priority's at both loads, and every run finishes
(`SimulationStalled` otherwise).

The slice: each trace's first 600 requests (seed 1), every policy with `--max-expected-wait 2`
and an aging bound of 10 s (the benchmark's 30 s is not reached in a slice this short). One
goal is not met and is marked so (strict xfail): goodput on the code trace at 0.5x.

The capacities (requests/s) are `benchmarks/policies.py`'s measured ones for this setup
(h200 + llama3-8b-sim, 128 sequences; docs/benchmarks.md), an input of the load, not a result.
"""

from __future__ import annotations

import argparse
import random

import pytest

from testing import overload as bench

CAPACITY = {"conv": 23.319, "code": 19.509}
NUM_REQUESTS = 600
LOW, HIGH = 0.5, 1.5
MAX_WAIT = 10.0  # the aging bound: shorter than the benchmark's 30 s, so a slice this short reaches it


SEED = 1


def sim_args(sim_model_dir) -> argparse.Namespace:
    """`benchmarks/policies.py`'s setup (its defaults) for every policy's run."""
    return argparse.Namespace(model=str(sim_model_dir), sim_profile="h200", max_num_seqs=128, max_wait_time=MAX_WAIT,
                              score_ttft_target=bench.TTFT_SLO_S, max_expected_wait=2.0, preemption_min_progress=None,
                              extra=[])


_rows: dict[tuple[str, str], dict] = {}


def rows_of(trace: str, sim_model_dir, tmp_path_factory) -> dict:
    """(load, policy) -> `bench.quality` row of the trace's slice, each run once per session;
    every run finishes (`run_sim` raises SimulationStalled if it stops progressing)."""
    key = (trace, str(sim_model_dir))
    if key not in _rows:
        args, rows, work = sim_args(sim_model_dir), {}, tmp_path_factory.mktemp(trace)
        for load in (LOW, HIGH):
            path = bench.write_trace(work / f"{load}.jsonl", bench.bursty_rows(
                random.Random(SEED), NUM_REQUESTS, load * CAPACITY[trace], bench.SHAPES[trace]))
            for policy in bench.POLICIES:
                result = bench.run_sim(args, path, policy)
                assert all(r["finish_reason"] for r in result["requests"]), f"{trace} {load}x {policy}: unfinished"
                rows[load, policy] = bench.quality(result, MAX_WAIT)
        _rows[key] = rows
    return _rows[key]


@pytest.mark.parametrize("trace", ["conv", "code"])
def test_score_protects_priority_0_and_streams_and_bounds_the_wait(sim_model_dir, tmp_path_factory, trace):
    rows = rows_of(trace, sim_model_dir, tmp_path_factory)
    low, high = rows[LOW, "score"], rows[HIGH, "score"]
    assert high["num_shed"] > 0, "1.5x is overload: some requests are shed"  # the slice does overload
    p0_low, p0_high = low["classes"]["0"]["p99_ttft_ms"], high["classes"]["0"]["p99_ttft_ms"]
    assert p0_high <= 2 * p0_low, f"{trace}: priority-0 p99 TTFT {p0_high:.0f} ms at 1.5x vs {p0_low:.0f} at 0.5x"
    tpot_low, tpot_high = low["all"]["p99_tpot_ms"], high["all"]["p99_tpot_ms"]
    assert tpot_high <= 2 * tpot_low, f"{trace}: TPOT p99 {tpot_high:.0f} ms at 1.5x vs {tpot_low:.0f} at 0.5x"
    for load in (LOW, HIGH):
        score = rows[load, "score"]
        assert score["waits_over_bound"] == 0, (
            f"{trace} {load}x: {score['waits_over_bound']} requests waited past {MAX_WAIT:g} s "
            f"(max {score['max_queue_wait_s']:.1f} s)")


@pytest.mark.parametrize("trace, load", [
    ("conv", LOW), ("conv", HIGH),
    pytest.param("code", LOW, marks=pytest.mark.xfail(strict=True, reason=(
        "not met: in the half-load bursts score lets priority 0 and 1 go first and more priority-2 "
        "prompts miss the 2 s TTFT than under fcfs (docs/benchmarks.md)"))),
    ("code", HIGH)])
def test_score_goodput_is_at_least_fcfs_and_priority(sim_model_dir, tmp_path_factory, trace, load):
    rows = rows_of(trace, sim_model_dir, tmp_path_factory)
    score = rows[load, "score"]["goodput"]
    for other in ("fcfs", "priority"):
        assert score >= rows[load, other]["goodput"], (
            f"{trace} {load}x: goodput score {score:.1%} < {other} {rows[load, other]['goodput']:.1%}")
