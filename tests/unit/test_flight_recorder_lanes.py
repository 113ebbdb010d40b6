"""The flight recorder's trace has one scheduler lane and one device lane per replica."""

from __future__ import annotations

from stepahead.flight_recorder import StepRecord, to_chrome_trace
from stepahead.plan import WorkerTiming


def test_one_lane_pair_per_replica():
    records = [StepRecord(i // 2, 1.0 + i, 1.1 + i, 1, 1, 1, 0, plan_sent=1.2 + i,
                          worker=WorkerTiming(forward_start=1.3 + i, forward_end=1.4 + i), replica=f"w{i % 2}")
               for i in range(4)]
    trace = to_chrome_trace(records)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert names == {1: "scheduler for worker w0", 2: "worker w0", 3: "scheduler for worker w1", 4: "worker w1"}
    forwards = [(e["pid"], e["args"]["step"]) for e in trace if e["ph"] == "X" and e["name"] == "forward+sample"]
    assert forwards == [(2, 0), (4, 0), (2, 1), (4, 1)]  # same step ids, separate lanes


def test_records_without_a_replica_keep_the_single_worker_lane():
    trace = to_chrome_trace([StepRecord(0, 1.0, 1.1, 1, 1, 1, 0)], worker_name="worker x")["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"scheduler for worker x", "worker x"}
