"""The adaptive in-flight window (`scheduler_service/window.py`): one step ahead, one more per
step the device waited for, back after a quiet run; and the scheduler stays exact whatever the
window does (the synchronous oracle, every block accounted)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import replace

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.window import LATE_S, AdaptiveWindow, is_late
from stepahead.plan import SamplingParams, WorkerTiming
from tests.unit.fake_executor import Driver, RequestSpec, eos_at, hashed_tokens, run_alone

BASE = SchedulerConfig(num_gpu_blocks=48, max_model_len=64, block_size=4, max_num_batched_tokens=16,
                       eos_token_ids=(0,), async_scheduling=True, max_concurrent_batches=3,
                       adaptive_concurrent_batches=True)


def test_the_window_from_the_config():
    assert (AdaptiveWindow.of(BASE).base, AdaptiveWindow.of(BASE).cap) == (2, 3)
    fixed = AdaptiveWindow.of(replace(BASE, adaptive_concurrent_batches=False))
    assert (fixed.base, fixed.size, fixed.cap) == (3, 3, 3)
    sync = AdaptiveWindow.of(replace(BASE, async_scheduling=False))
    assert (sync.base, sync.size, sync.cap) == (1, 1, 1)
    assert AdaptiveWindow.of(replace(BASE, max_concurrent_batches=1)).size == 1
    with pytest.raises(ValueError):
        AdaptiveWindow(3, 2)


def test_late_steps_in_a_burst_widen_it_and_a_quiet_run_narrows_it_again():
    w = AdaptiveWindow(2, 4, burst_steps=2, hold_steps=3)
    w.on_step(True)
    assert w.size == 2, "a lone late step: the control plane is not falling behind"
    w.on_step(False)
    w.on_step(False)
    w.on_step(True)
    assert w.size == 2, "two steps after the last: still alone (burst_steps=2)"
    w.on_step(True)
    assert w.size == 3, "right after another: one step deeper"
    w.on_step(False)
    w.on_step(True)
    assert w.size == 4, "within the burst again: up to the cap"
    w.on_step(True)
    assert w.size == 4
    w.on_step(False)
    w.on_step(False)
    assert w.size == 4
    w.on_step(False)
    assert w.size == 3, "three quiet steps in a row: one step less"
    for _ in range(3):
        w.on_step(False)
    assert w.size == 2
    w.on_step(True)
    assert w.size == 2, "a late step long after the last one is alone again"
    for _ in range(10):
        w.on_step(False)
    assert w.size == 2, "never below the base"
    with pytest.raises(ValueError):
        AdaptiveWindow(2, 3, burst_steps=5, hold_steps=4)


def test_only_a_plan_made_on_commit_that_the_device_waited_for_is_late():
    assert is_late(LATE_S * 2, planned_on_commit=True)
    assert not is_late(LATE_S * 2, planned_on_commit=False), "planned when new work came: no window could help"
    assert not is_late(LATE_S / 2, planned_on_commit=True)
    assert not is_late(-0.004, planned_on_commit=True), "launched before the previous step ended"


class ClockedDriver(Driver):
    """The fake executor's results stamped with device times: each step lasts 1 ms and starts
    when launched or when the previous one ends; the launch comes `delay()` after the plan."""

    def __init__(self, *args, delay) -> None:
        super().__init__(*args)
        self.delay, self.now, self.device_free, self.sizes, self.on_commit = delay, 0.0, 0.0, [], False

    def tick(self) -> None:
        """As the engine: plans made right after a commit are marked so (the whole pump)."""
        while self.step():
            pass
        self.on_commit = False
        if self.results:
            self.deliver()
            self.on_commit = True
        elif self.scheduler.has_unfinished_requests():
            raise AssertionError("stuck")

    def step(self) -> bool:
        plan = self.loop.plan_next(self.on_commit)
        if plan is None:
            return False
        self.plans.append(plan)
        start = max(self.now + self.delay(), self.device_free)
        self.device_free = start + 0.001
        timing = WorkerTiming(forward_start=start, forward_end=self.device_free)
        self.results.append(dataclasses.replace(self.executor.execute(plan), timing=timing))
        self.sizes.append(self.loop.num_in_flight)
        return True

    def deliver(self):
        self.now = max(self.now, self.results[0].timing.forward_end)
        return super().deliver()


def specs(rng: random.Random) -> list[RequestSpec]:
    return [RequestSpec(f"r{i}", tuple(rng.randrange(1, 900) for _ in range(rng.randint(1, 20))),
                        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24)))
            for i in range(12)]


@pytest.mark.parametrize("seed", range(12))
def test_any_lateness_keeps_tokens_exact(seed):
    rng = random.Random(seed)
    config = replace(BASE, num_gpu_blocks=rng.choice([24, 48]))
    token_fn = eos_at(0, {"r3": 5, "r7": 2}, hashed_tokens(1000))
    base = Driver.create(config, token_fn)
    d = ClockedDriver(base.scheduler, base.executor, delay=lambda: rng.choice([0.0, 0.0, 0.003]))
    d.loop.window.burst_steps, d.loop.window.hold_steps = 3, 4
    todo = specs(rng)
    for spec in todo[:6]:
        d.scheduler.add_request(spec.build())
    ticks = 0
    while d.scheduler.has_unfinished_requests() or d.results:
        if ticks == 5:
            for spec in todo[6:]:
                d.scheduler.add_request(spec.build())
        d.tick()
        d.scheduler.check_integrity()
        ticks += 1
        assert ticks < 5000
    assert max(d.sizes) == 3 and 2 in d.sizes, "the window went deeper and came back"
    for spec in todo:
        assert (d.outputs[spec.request_id], d.finished[spec.request_id]) == run_alone(config, spec, token_fn)


def test_a_device_that_never_waits_keeps_one_step_ahead():
    base = Driver.create(BASE, hashed_tokens(1000))
    d = ClockedDriver(base.scheduler, base.executor, delay=lambda: 0.0)
    for spec in specs(random.Random(0)):
        d.scheduler.add_request(spec.build())
    d.run_until_done()
    assert max(d.sizes) == 2 and d.loop.window.size == 2
