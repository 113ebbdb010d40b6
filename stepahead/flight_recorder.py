"""Flight recorder: a ring buffer of the last N steps, exportable as a Chrome/Perfetto trace.

Timestamps are wall-clock seconds (`time.time()`), so the scheduler's and the workers'
records line up on one timeline. The scheduler fills the CPU side (schedule start/end,
plan sent, result committed); the worker's timings for the same step arrive with its
result (plan received, input prep start, forward start/end, result sent).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from stepahead.plan import WorkerTiming


@dataclass
class StepRecord:
    step_id: int
    schedule_start: float
    schedule_end: float
    num_requests: int
    num_tokens: int
    num_running: int
    num_waiting: int
    plan_sent: float = 0.0
    commit_start: float = 0.0
    result_committed: float = 0.0
    worker: WorkerTiming = field(default_factory=WorkerTiming)
    replica: str = ""  # the worker id of the replica that ran it (step ids count per replica)


class FlightRecorder:
    """Thread-safe ring buffer of StepRecords keyed by step id."""

    def __init__(self, capacity: int = 1000) -> None:
        self._records: collections.OrderedDict[int, StepRecord] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, record: StepRecord) -> None:
        with self._lock:
            self._records[record.step_id] = record
            while len(self._records) > self._capacity:
                self._records.popitem(last=False)

    def get(self, step_id: int) -> StepRecord | None:
        with self._lock:
            return self._records.get(step_id)

    def snapshot(self) -> list[StepRecord]:
        with self._lock:
            return list(self._records.values())


def device_busy_intervals(records: Iterable[StepRecord]) -> list[tuple[float, float]]:
    return [(r.worker.forward_start, r.worker.forward_end) for r in records if r.worker.forward_end > 0]


def device_idle_fraction(records: Iterable[StepRecord], start: float | None = None, end: float | None = None) -> float:
    """1 - busy / elapsed over [start, end] (default: first forward start to last forward end)."""
    busy = sorted(device_busy_intervals(records))
    if not busy:
        return 1.0
    start = busy[0][0] if start is None else start
    end = busy[-1][1] if end is None else end
    if end <= start:
        return 0.0
    total, cursor = 0.0, start
    for a, b in busy:  # union of intervals, clipped to the window
        a, b = max(a, cursor), min(b, end)
        if b > a:
            total += b - a
            cursor = b
    return max(0.0, 1.0 - total / (end - start))


def to_chrome_trace(records: Iterable[StepRecord], worker_name: str = "worker 0") -> dict:
    """Chrome trace-event JSON (opens in ui.perfetto.dev): one lane for the scheduler's CPU
    work and one per replica's worker (named by `StepRecord.replica`, else `worker_name`)."""
    records = list(records)
    lanes = {name: 2 * i + 1 for i, name in enumerate(dict.fromkeys(r.replica for r in records))}
    events: list[dict] = []
    for name, pid in lanes.items():
        label = f"worker {name}" if name else worker_name
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"scheduler for {label}"}})
        events.append({"ph": "M", "pid": pid + 1, "name": "process_name", "args": {"name": label}})

    def span(pid: int, tid: int, name: str, a: float, b: float, args: dict) -> None:
        if a > 0 and b >= a:
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": a * 1e6,
                           "dur": (b - a) * 1e6, "args": args})

    for r in records:
        sched, dev = lanes[r.replica], lanes[r.replica] + 1
        args = {"step": r.step_id, "requests": r.num_requests, "tokens": r.num_tokens,
                "running": r.num_running, "waiting": r.num_waiting}
        w = r.worker
        span(sched, 1, "schedule", r.schedule_start, r.schedule_end, args)
        span(sched, 1, "send", r.schedule_end, r.plan_sent, args)
        span(sched, 1, "commit", r.commit_start, r.result_committed, args)
        span(sched, 2, "in flight", r.plan_sent, r.commit_start, args)
        span(dev, 1, "prepare", w.prep_start, w.forward_start, args)
        span(dev, 1, "forward+sample", w.forward_start, w.forward_end, args)
        span(dev, 2, "queued", w.plan_received, w.prep_start, args)
        span(dev, 2, "send result", w.forward_end, w.result_sent, args)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
