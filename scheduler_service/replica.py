"""One data-parallel replica: an attached worker and the scheduler state that is its own.

A replica has its own scheduler core (waiting queue, KV block accounting, prefix cache),
its own `StepLoop` (the in-flight window, so a slow replica never holds another's steps)
and its own flight-recorder lane. The engine owns the replicas and runs them all on its
one event loop; nothing here locks.
"""

from __future__ import annotations

import time

from scheduler_service.links import WorkerHandle
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.core.events import StepEvents
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.step_loop import StepLoop
from stepahead.flight_recorder import FlightRecorder, StepRecord
from stepahead.plan import StepPlan, StepResult


class Replica:
    def __init__(self, handle: WorkerHandle, scheduler: Scheduler, recorder_steps: int) -> None:
        self.handle = handle
        self.scheduler = scheduler
        self.loop = StepLoop(scheduler)
        self.recorder = FlightRecorder(recorder_steps)
        self.last_progress = time.monotonic()  # last commit, or a send into an empty window

    @property
    def name(self) -> str:
        return self.handle.info.worker_id

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished

    def step_deadline(self, timeout_s: float) -> float | None:
        """When the oldest plan in flight is overdue (monotonic), None when none is in flight."""
        return self.last_progress + timeout_s if self.loop.num_in_flight else None

    def pump(self, on_commit: bool = False) -> None:
        """Plan and send steps while the in-flight window has room (`on_commit`: a commit just
        made room, see `StepLoop.plan_next`)."""
        while True:
            start = time.time()
            was_empty = not self.loop.num_in_flight
            plan = self.loop.plan_next(on_commit)
            if plan is None:
                return
            record = self._record(plan, start)
            if was_empty:
                self.last_progress = time.monotonic()
            self.handle.outbox.send(plan)
            record.plan_sent = time.time()

    def commit(self, result: StepResult, metrics: SchedulerMetrics) -> StepEvents:
        """Commit the oldest plan's result (ValueError: it does not fit, nothing committed),
        send the next plan before anyone is told, then account the step."""
        start = time.time()
        plan, events = self.loop.commit(result)
        self.last_progress = time.monotonic()
        metrics.on_window(self.name, self.loop.window.size, self.loop.last_idle_s, self.loop.last_late)
        self.pump(on_commit=True)  # the next plan leaves before clients are served: the device waits for it
        record = self.recorder.get(plan.step_id)
        if record is not None:
            record.commit_start, record.result_committed, record.worker = start, time.time(), result.timing
            metrics.on_step(record)
        return events

    def _record(self, plan: StepPlan, start: float) -> StepRecord:
        num_running, num_waiting = self.scheduler.queue_lengths()
        record = StepRecord(
            step_id=plan.step_id, schedule_start=start, schedule_end=time.time(),
            num_requests=plan.num_requests, num_tokens=plan.num_scheduled_tokens,
            num_running=num_running, num_waiting=num_waiting, replica=self.name,
        )
        self.recorder.add(record)
        return record
