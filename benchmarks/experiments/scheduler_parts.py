"""The scheduler daemon's CPU per decode step, part by part, in one process (no gRPC).

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/scheduler_parts.py [--running 32 256 1024] [--steps 300]
        [--out benchmarks/results/scheduler_parts.json]

Each step does what the daemon's engine does for one replica with N running decode requests
(and 1k waiting ones that cannot be admitted): `schedule()`, the plan encoded as the worker
gets it (`plan_to_proto` + serialize), the worker's result parsed and decoded
(`result_from_proto`), `update_from_output`, the metrics hooks, and the event fan-out (each
gateway session's events as its Connect writer encodes them, `event_batches`, serialized).
Beside the parts, not in the total: the same events encoded as before plain tokens were
packed (one full `TokenEvent` each, `add_event`), and the bytes per step of both forms. A
minimal worker stand-in (not timed) answers each plan. What this leaves out is the daemon's
gRPC and thread hand-offs: `benchmarks/capacity.py --profile-cpu` measures those in the real
daemons.
Async scheduling (two plans in flight), medians of per-step process CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from pathlib import Path

from benchmarks.experiments.scheduler import NUM_WAITING, PROMPT_LEN, EchoWorker, add, make_scheduler
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.event_batches import add_event, event_batches
from scheduler_service.core.events import PlainTokens, RequestEvent, split_plain
from stepahead import codec
from stepahead.flight_recorder import StepRecord
from stepahead.plan import WorkerTiming
from stepahead.v1 import scheduler_pb2

PARTS = ("schedule", "plan encode", "result decode", "update", "metrics", "event fan-out")
BESIDE = ("fan-out all full",)  # measured on the same events, not part of the step


class Parts:
    """One replica's per-step path with a CPU stopwatch per part."""

    def __init__(self, num_running: int, num_sessions: int) -> None:
        self.sched = make_scheduler(num_running, True)
        self.worker, self.metrics = EchoWorker(), SchedulerMetrics()
        self.in_flight: deque = deque()
        self.times = {p: 0.0 for p in PARTS}
        self.beside = dict.fromkeys(BESIDE, 0.0)
        self.bytes = {"packed": 0, "full": 0}
        self.num_sessions = num_sessions
        self.session_of: dict[str, int] = {}  # request id -> its gateway session (the engine's streams)
        self.scope = "1/"

    def _timed(self, part: str, fn, *args):
        t0 = time.process_time()
        out = fn(*args)
        self.times[part] += time.process_time() - t0
        return out

    def step(self) -> dict[str, float]:
        self.times = dict.fromkeys(PARTS, 0.0)
        while self.sched.can_schedule():
            plan = self._timed("schedule", self.sched.schedule)
            if plan is None:
                break
            self._timed("plan encode", self._encode_plan, plan)
            wire = codec.result_to_proto(self.worker.execute(plan)).SerializeToString()
            self.in_flight.append((plan, wire))
        plan, wire = self.in_flight.popleft()
        result = self._timed("result decode", lambda w: codec.result_from_proto(scheduler_pb2.StepResult.FromString(w)),
                             wire)
        events = self._timed("update", self.sched.update_from_output, plan, result)
        record = StepRecord(step_id=plan.step_id, schedule_start=0.0, schedule_end=1e-4, num_requests=0, num_tokens=0,
                            num_running=0, num_waiting=0, worker=WorkerTiming())
        self._timed("metrics", lambda: (self.metrics.on_step_events(events),
                                        self.metrics.on_step(record),
                                        self.metrics.on_window("r0", 2, 0.0, False)))
        self.bytes["packed"] = self._timed("event fan-out", self._fan_out, events)
        t0 = time.process_time()
        self.bytes["full"] = self._fan_out_all_full(events)
        self.beside = {"fan-out all full": time.process_time() - t0}
        return self.times

    @staticmethod
    def _encode_plan(plan) -> bytes:
        """As the daemon's AttachWorker writer: the plan built inside its SchedulerMessage."""
        msg = scheduler_pb2.SchedulerMessage()
        codec.plan_to_proto(plan, msg.plan)
        return msg.SerializeToString()

    def _sessions(self, events) -> list[list]:
        """A step's events per gateway session, as the engine dispatches them (a session's plain
        tokens as one `PlainTokens`, after its other events)."""
        batches: list[list] = [[] for _ in range(self.num_sessions)]
        for event in events.events:
            batches[self.session_of[event.request_id]].append(event)
        for session, part in split_plain(events.plain, self.session_of.get):
            batches[session].append(part)
        return batches

    def _fan_out(self, events) -> int:
        """As the Connect writers send them (bytes returned)."""
        return sum(len(b.SerializeToString()) for batch in self._sessions(events)
                   for b in event_batches(batch, len(self.scope)))

    def _fan_out_all_full(self, events) -> int:
        """The writer before plain tokens were packed: one full TokenEvent per event."""
        size = 0
        for batch in self._sessions(events):
            msg = scheduler_pb2.EventBatch()
            for item in batch:
                for event in ([RequestEvent(rid, (t,), None, PROMPT_LEN, 0) for rid, t in item]
                              if type(item) is PlainTokens else [item]):
                    add_event(msg, event, len(self.scope))
            size += len(msg.SerializeToString())
        return size


def measure(num_running: int, steps: int, num_sessions: int) -> dict:
    parts = Parts(num_running, num_sessions)
    add(parts.sched, parts.scope + "run", num_running)
    for i in range(num_running):
        parts.metrics.on_submit(f"{parts.scope}run{i}")
        parts.session_of[f"{parts.scope}run{i}"] = i % num_sessions
    while parts.sched.queue_lengths()[0] < num_running:
        parts.step()
    for _ in range(4):
        parts.step()
    add(parts.sched, parts.scope + "wait", NUM_WAITING)
    rows, beside, sizes = [], [], []
    for _ in range(steps):
        rows.append(parts.step())
        beside.append(parts.beside)
        sizes.append(dict(parts.bytes))
    assert parts.sched.queue_lengths()[0] == num_running, parts.sched.stats()
    parts.sched.check_integrity()
    out = {"running": num_running, "gateway_sessions": num_sessions}
    out.update({f"{p}_ms": statistics.median(r[p] for r in rows) * 1e3 for p in PARTS})
    out["total_ms"] = statistics.median(sum(r.values()) for r in rows) * 1e3
    out.update({f"{p}_ms": statistics.median(r[p] for r in beside) * 1e3 for p in BESIDE})
    out.update({f"event_bytes_{k}": statistics.median(r[k] for r in sizes) for k in ("packed", "full")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--gateway-sessions", type=int, default=1)
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    rows = [measure(n, args.steps, args.gateway_sessions) for n in args.running]
    print(f"{'running':>8} " + " ".join(f"{p:>14}" for p in PARTS) + f" {'total':>8}"
          + "".join(f" | {p:>16}" for p in BESIDE) + "  (ms CPU per step, median)")
    for r in rows:
        print(f"{r['running']:>8} " + " ".join(f"{r[p + '_ms']:>14.3f}" for p in PARTS) + f" {r['total_ms']:>8.3f}"
              + "".join(f" | {r[p + '_ms']:>16.3f}" for p in BESIDE)
              + f"   bytes/step packed {r['event_bytes_packed']:.0f}, all full {r['event_bytes_full']:.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
