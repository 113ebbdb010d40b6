"""How many plans a replica keeps in flight (the async window), and when it plans further ahead.

One step ahead (two plans in flight) hides the control plane behind the device as long as
the chain from a step's end to the launch of the plan after next fits in one device step:
the result leaves the worker, is committed, the next plan is made, sent, and launched
(`benchmarks/experiments/critical_chain.py`). When the chain does not fit (a loaded host, short decode
steps), the device waits for its plan. The adaptive window then plans one step further
ahead, up to `--max-concurrent-batches`, when a late step follows another within
`burst_steps` steps, and goes back one step after `hold_steps` steps without a late plan: a
deeper window costs a newly arrived request one more step before its first token
(`benchmarks/experiments/window_latency.py`), so it is used only while it buys device time:
at moderate load late steps are rare and come alone, at high concurrency they come in bursts
(`benchmarks/capacity.py` counts them, `stepahead:late_plans_total`). A fixed window
(`--no-adaptive-concurrent-batches`) always plans up to the maximum.

Pure: the engine's `StepLoop` (which the offline simulator drives too) feeds it one verdict per committed
step (`is_late`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.config import SchedulerConfig

LATE_S = 0.0005  # the device idled this long before a step whose plan was made as early as the window allowed
ONE_STEP_AHEAD = 2  # plans in flight of the async loop without deepening: the step running and the next


def is_late(idle_before_s: float, planned_on_commit: bool) -> bool:
    """Was the device kept waiting by the window? `idle_before_s`: how long it sat idle
    between the previous step's end and this step's start; `planned_on_commit`: the plan was
    made in a commit, as soon as the window had room (not later, when new work arrived)."""
    return planned_on_commit and idle_before_s > LATE_S


@dataclass
class AdaptiveWindow:
    """Plans in flight: `base`, widened by one (up to `cap`) by a late step that comes within
    `burst_steps` steps of the previous late one, narrowed by one after `hold_steps` steps in a
    row without one."""

    base: int
    cap: int
    burst_steps: int = 16
    hold_steps: int = 64
    size: int = field(init=False)
    _quiet: int = field(default=0, init=False)  # steps since the last late one

    def __post_init__(self) -> None:
        if not 1 <= self.base <= self.cap:
            raise ValueError(f"window needs 1 <= base <= cap, got base {self.base}, cap {self.cap}")
        if not 1 <= self.burst_steps <= self.hold_steps:
            raise ValueError(f"window needs 1 <= burst_steps <= hold_steps, got {self.burst_steps}, {self.hold_steps}")
        self.size, self._quiet = self.base, self.hold_steps  # no late step seen yet

    @classmethod
    def of(cls, config: SchedulerConfig) -> AdaptiveWindow:
        """Synchronous: 1. Async: one step ahead, deepening up to `max_concurrent_batches` when
        `adaptive_concurrent_batches`; else always `max_concurrent_batches`."""
        cap = config.max_in_flight
        base = min(ONE_STEP_AHEAD, cap) if config.async_scheduling and config.adaptive_concurrent_batches else cap
        return cls(base, cap)

    def on_step(self, late: bool) -> None:
        if late:
            if self._quiet < self.burst_steps:  # not a lone late step: the control plane falls behind
                self.size = min(self.size + 1, self.cap)
            self._quiet = 0
            return
        self._quiet += 1
        if self._quiet % self.hold_steps == 0 and self.size > self.base:
            self.size -= 1
