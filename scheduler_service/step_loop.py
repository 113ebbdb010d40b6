"""The in-flight window of one replica, pure and synchronous: plan ahead, commit the oldest.

A `StepLoop` wraps one scheduler core. `plan_next()` plans one more step while the window
(`window.AdaptiveWindow`: 1 in synchronous mode, one step ahead or up to
`max_concurrent_batches`) has room; `commit(result)` commits the result of the oldest plan
in flight and tells the window whether the device waited for that step's plan. Results
must come back in plan order: anything else (an unknown, duplicated or out-of-order step, a
result that does not fit its plan) raises `ValueError` naming what is wrong, and nothing is
committed.

The daemon's engine drives one StepLoop per attached replica; the fake-executor driver and
the in-process integration engine drive the same class, so the window has one definition.
"""

from __future__ import annotations

import collections

from scheduler_service.core.events import StepEvents
from scheduler_service.core.result_checks import check_timing
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.window import AdaptiveWindow, is_late
from stepahead.plan import StepPlan, StepResult, WorkerTiming


class StepLoop:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.window = AdaptiveWindow.of(scheduler.config)
        self._in_flight: collections.deque[StepPlan] = collections.deque()
        self._planned_on_commit: set[int] = set()  # step ids planned as soon as a commit made room
        self._last_forward_end = 0.0  # of the last committed step, on the worker's clock
        self.last_idle_s: float | None = None  # the device idle before the last committed step (None: unknown)
        self.last_late = False  # the device waited for the last committed step's plan (see `window.is_late`)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def oldest(self) -> StepPlan | None:
        return self._in_flight[0] if self._in_flight else None

    def is_idle(self) -> bool:
        """Nothing in flight and nothing left to serve."""
        return not self._in_flight and not self.scheduler.has_unfinished_requests()

    def plan_next(self, on_commit: bool = False) -> StepPlan | None:
        """One more plan if the window has room and there is work; None otherwise.
        `on_commit`: called right after a commit made room (the window's lateness signal)."""
        if len(self._in_flight) >= self.window.size or not self.scheduler.can_schedule():
            return None
        plan = self.scheduler.schedule()
        if plan is not None:
            self._in_flight.append(plan)
            if on_commit:
                self._planned_on_commit.add(plan.step_id)
        return plan

    def plan_ahead(self) -> list[StepPlan]:
        """Fill the window; returns the new plans in order."""
        plans = []
        while (plan := self.plan_next()) is not None:
            plans.append(plan)
        return plans

    def commit(self, result: StepResult) -> tuple[StepPlan, StepEvents]:
        """Commit `result` as the oldest plan's; raises ValueError (nothing committed) when it
        is not that plan's result or does not fit it."""
        if not self._in_flight:
            raise ValueError(f"result for step {result.step_id}, but no step is in flight")
        plan = self._in_flight[0]
        if plan.step_id != result.step_id:
            raise ValueError(f"result for step {result.step_id}, but step {plan.step_id} is the oldest in flight")
        check_timing(result)
        events = self.scheduler.update_from_output(plan, result)
        self._in_flight.popleft()
        self._adapt(plan.step_id, result.timing)
        return plan, events

    def _adapt(self, step_id: int, timing: WorkerTiming) -> None:
        """The window's verdict on a committed step: did the device idle waiting for its plan?
        (The one place the device's idle gap is taken: the metrics observe `last_idle_s`.)"""
        on_commit = step_id in self._planned_on_commit
        self._planned_on_commit.discard(step_id)
        self.last_idle_s, self.last_late = None, False
        if timing.forward_start and self._last_forward_end:
            self.last_idle_s = timing.forward_start - self._last_forward_end
            self.last_late = is_late(self.last_idle_s, on_commit)
            self.window.on_step(self.last_late)
        self._last_forward_end = timing.forward_end or self._last_forward_end
