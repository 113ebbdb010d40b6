"""Issue 37's goals on short slices of both real production traces (the Azure LLM inference
trace 2023's conversation and code services, `benchmarks/data/azure_llm_2023/`: real lengths,
real inter-arrival times rescaled to the load), through the deterministic offline simulator, as `benchmarks/policies.py` measures them: the
score policy at 1.5x its capacity keeps priority 0's p99 TTFT and the TPOT p99 within 2x
their values at 0.5x, no request waits in the queue past the aging bound (overload is shed
instead), its goodput is at least fcfs's and priority's at both loads, and every run finishes
(`SimulationStalled` otherwise).

The slice: each trace's first 600 requests (priority classes drawn with seed 1), every policy with `--max-expected-wait 2`
and an aging bound of 10 s (the benchmark's 30 s is not reached in a slice this short). One
goal is not met and is marked so (strict xfail): the TPOT tail on the conversation trace at
1.5x, which is chunked-prefill interference at saturation (fcfs, which never preempts, misses it
too); what preemption adds is checked against fcfs instead.

The capacities (requests/s) are `benchmarks/policies.py`'s measured ones for this setup
(h200 + llama3-8b-sim, 128 sequences; docs/benchmarks.md), an input of the load, not a result.
"""

from __future__ import annotations

import argparse

import pytest

from testing import overload as bench

CAPACITY = {"conv": 24.576, "code": 18.722}
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
            path = bench.write_trace(work / f"{load}.jsonl", bench.azure_rows(
                bench.AZURE_TRACES[trace], NUM_REQUESTS, load * CAPACITY[trace], SEED))
            for policy in bench.POLICIES:
                result = bench.run_sim(args, path, policy)
                assert all(r["finish_reason"] for r in result["requests"]), f"{trace} {load}x {policy}: unfinished"
                rows[load, policy] = bench.quality(result, MAX_WAIT)
        _rows[key] = rows
    return _rows[key]


@pytest.mark.parametrize("trace", ["conv", "code"])
def test_score_protects_priority_0_and_bounds_the_wait_without_thrash(sim_model_dir, tmp_path_factory, trace):
    rows = rows_of(trace, sim_model_dir, tmp_path_factory)
    low, high = rows[LOW, "score"], rows[HIGH, "score"]
    assert high["num_shed"] > 0, "1.5x is overload: some requests are shed"  # the slice does overload
    p0_low, p0_high = low["classes"]["0"]["p99_ttft_ms"], high["classes"]["0"]["p99_ttft_ms"]
    assert p0_high <= 2 * p0_low, f"{trace}: priority-0 p99 TTFT {p0_high:.0f} ms at 1.5x vs {p0_low:.0f} at 0.5x"
    for load in (LOW, HIGH):
        score = rows[load, "score"]
        assert score["waits_over_bound"] == 0, (
            f"{trace} {load}x: {score['waits_over_bound']} requests waited past {MAX_WAIT:g} s "
            f"(max {score['max_queue_wait_s']:.1f} s)")
        # no thrash: a request preempted once is not preempted again (before it finishes)
        assert score["max_preemptions_per_request"] <= 1, (
            f"{trace} {load}x: a request was preempted {score['max_preemptions_per_request']} times")


@pytest.mark.parametrize("trace", [
    pytest.param("conv", marks=pytest.mark.xfail(strict=True, reason=(
        "not met: at 1.5x every step carries a chunk of prefill beside the full decode batch, and the "
        "TPOT tail is that interference, not preemption: fcfs, which never preempts, is above 2x too "
        "(docs/benchmarks.md)"))),
    "code"])
def test_score_tpot_tail_at_overload_within_twice_half_load(sim_model_dir, tmp_path_factory, trace):
    rows = rows_of(trace, sim_model_dir, tmp_path_factory)
    tpot_low, tpot_high = rows[LOW, "score"]["all"]["p99_tpot_ms"], rows[HIGH, "score"]["all"]["p99_tpot_ms"]
    assert tpot_high <= 2 * tpot_low, f"{trace}: TPOT p99 {tpot_high:.0f} ms at 1.5x vs {tpot_low:.0f} at 0.5x"


def test_score_tpot_tail_at_overload_is_not_above_fcfs_on_conversations(sim_model_dir, tmp_path_factory):
    """What preemption adds to the stream stalls: on the conversation trace, where score does
    preempt, its TPOT p99 at 1.5x is no worse than fcfs's (which never preempts)."""
    rows = rows_of("conv", sim_model_dir, tmp_path_factory)
    score, fcfs = rows[HIGH, "score"], rows[HIGH, "fcfs"]
    assert score["num_preemptions"] > 0 and fcfs["num_preemptions"] == 0
    assert score["all"]["p99_tpot_ms"] <= fcfs["all"]["p99_tpot_ms"], (
        f"TPOT p99 at 1.5x: score {score['all']['p99_tpot_ms']:.0f} ms, fcfs {fcfs['all']['p99_tpot_ms']:.0f} ms")


@pytest.mark.parametrize("trace, load", [("conv", LOW), ("conv", HIGH), ("code", LOW), ("code", HIGH)])
def test_score_goodput_is_at_least_fcfs_and_priority(sim_model_dir, tmp_path_factory, trace, load):
    rows = rows_of(trace, sim_model_dir, tmp_path_factory)
    score = rows[load, "score"]["goodput"]
    for other in ("fcfs", "priority"):
        assert score >= rows[load, other]["goodput"], (
            f"{trace} {load}x: goodput score {score:.1%} < {other} {rows[load, other]['goodput']:.1%}")
