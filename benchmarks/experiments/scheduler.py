"""Scheduler core cost per step: `schedule()` + `update_from_output()` with N running
decode requests and 1k waiting ones (which cannot be admitted: max_num_seqs = N).

    .venv/bin/python benchmarks/experiments/scheduler.py [--running 64 256 1024] [--steps 300] [--plot out.png]

A minimal worker stand-in (outside the timed region) answers each plan with one token per
sampling request, so the measured time is the scheduler's alone. Target: <= 1.5 ms per
step at 256 running, growing linearly.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from stepahead.plan import SamplingParams, StepPlan, StepResult

PROMPT_LEN, BLOCK_SIZE, NUM_WAITING = 128, 16, 1000


class EchoWorker:
    """Tracks known / computed lengths per request and samples token 7 when due."""

    def __init__(self) -> None:
        self.known: dict[str, int] = {}
        self.computed: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_ids + plan.preempted_ids:
            del self.known[rid], self.computed[rid]
        work = [(r.request_id, r.num_scheduled_tokens) for r in plan.running]
        for nr in plan.new_requests:
            self.known[nr.request_id] = len(nr.token_ids)
            self.computed[nr.request_id] = nr.num_computed_tokens
            work.append((nr.request_id, nr.num_scheduled_tokens))
        sampled = {}
        for rid, n in work:
            self.computed[rid] += n
            if self.computed[rid] == self.known[rid]:
                self.known[rid] += 1
                sampled[rid] = 7
        return StepResult(plan.step_id, sampled)


def make_scheduler(num_running: int, async_scheduling: bool) -> Scheduler:
    blocks_per_req = (PROMPT_LEN + 4096) // BLOCK_SIZE
    config = SchedulerConfig(
        num_gpu_blocks=num_running * blocks_per_req + 64,
        max_model_len=PROMPT_LEN + 8192,
        block_size=BLOCK_SIZE,
        max_num_seqs=num_running,
        max_num_batched_tokens=max(2048, num_running),
        async_scheduling=async_scheduling,
        eos_token_ids=(0,),
    )
    return Scheduler(config)


def add(sched: Scheduler, prefix: str, count: int) -> None:
    sampling = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(count):
        prompt = [1 + (i * 7 + j) % 30000 for j in range(PROMPT_LEN)]
        sched.add_request(Request(f"{prefix}{i}", prompt, sampling))


class Loop:
    """The daemon loop: fill the in-flight window, then commit the oldest result."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.worker = sched, EchoWorker()
        self.in_flight: deque[tuple[StepPlan, StepResult]] = deque()

    def step(self) -> float:
        """One turn; returns the scheduler's own time in it (seconds)."""
        cost = 0.0
        while self.sched.can_schedule():
            t0 = time.process_time()
            plan = self.sched.schedule()
            cost += time.process_time() - t0
            if plan is None:
                break
            self.in_flight.append((plan, self.worker.execute(plan)))
        plan, result = self.in_flight.popleft()
        t0 = time.process_time()
        self.sched.update_from_output(plan, result)
        return cost + time.process_time() - t0


def measure(num_running: int, steps: int, async_scheduling: bool) -> dict[str, float]:
    sched = make_scheduler(num_running, async_scheduling)
    loop = Loop(sched)
    add(sched, "run", num_running)
    while sched.stats().num_running < num_running:
        loop.step()
    for _ in range(4):  # every running request is decoding now
        loop.step()
    add(sched, "wait", NUM_WAITING)
    times = [loop.step() for _ in range(steps)]
    stats = sched.stats()
    assert stats.num_running == num_running and stats.num_waiting == NUM_WAITING, stats
    sched.check_integrity()
    return {
        "running": num_running,
        "mode": "async" if async_scheduling else "sync",
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": statistics.quantiles(times, n=10)[-1] * 1e3,
        "mean_ms": statistics.fmean(times) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plot", help="write a PNG of cost per step vs running requests")
    args = parser.parse_args()
    rows = [measure(n, args.steps, mode) for mode in (True, False) for n in args.running]
    print(f"{'running':>8} {'mode':>6} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8} {'us/request':>10}")
    for r in rows:
        per_req = r["median_ms"] * 1e3 / r["running"]
        print(f"{r['running']:>8} {r['mode']:>6} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} {r['mean_ms']:>8.3f} {per_req:>10.2f}")
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mode in ("async", "sync"):
        pts = [(r["running"], r["median_ms"]) for r in rows if r["mode"] == mode]
        ax.plot(*zip(*pts), marker="o", label=mode)
    ax.axhline(1.5, color="gray", linestyle="--", label="target @256")
    ax.set(xlabel="running decode requests (+1k waiting)", ylabel="schedule + update (ms/step)", xscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
