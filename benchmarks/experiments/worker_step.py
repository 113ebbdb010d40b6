"""CPU of the sim worker's per-step path, and of the scheduler's side of the plan/result codec.

    python benchmarks/experiments/worker_step.py [--rows 32 256 1024] [--steps 200] [--profile-rows 256]
                                     [--label after] [--out benchmarks/results/worker_step.json]

Before / after in one file: copy this script into a checkout of the old commit and run it
there with `--label before` and the same `--out` (the file keeps each label's run).

Drives `--device sim` exactly as the worker daemon does, in one process, no gRPC and no
sleeping: for each decode step the "scheduler" encodes a `StepPlan` (`plan_to_proto`, the
`SchedulerMessage` wrapper, `SerializeToString`: what gRPC sends); the worker parses the
bytes, decodes (`plan_from_proto`), counts (`WorkerMetrics.on_plan`), launches
(`SimRunner.launch`: sampling-row limits, `check_plan`, applying the deltas, the token
function, the cost model), waits (`SimPendingStep.wait` with its deadline moved to now, so
the sleep, which costs no CPU, is not timed), stamps `result_sent`, encodes and serialises
the `WorkerMessage`, observes its metrics; the scheduler parses and decodes the result
(`result_from_proto`). Each part is timed on every step in CPU time of the thread (`thread_time_ns`:
other processes on a loaded machine do not count; sleeps would not either); the table
gives the median over `--steps` steps, in µs per step and per request.

The workload is the capacity benchmark's steady state (h200 + llama3-8b-sim): `rows`
requests with 512-token prompts (staggered by up to 15 tokens, so 1 in 16 gets a new KV
block per step), registered by one prefill plan, then decode steps with placeholder inputs
(the async loop's plans). `--profile-rows N` also prints a cProfile of the worker's path at
N rows. `--evict-mb 64` starts every step with cold CPU caches (the daemon's steps are ~20 ms
apart, with other processes running in between). `calibration_us` times `sum(range(10_000))` the same way (machine speed and load).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import statistics
import time
from pathlib import Path

from benchmarks.machine import calibration_us
from stepahead import codec
from model_zoo.builtin_models import resolve_model
from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
from stepahead.v1 import scheduler_pb2
from worker_service.metrics import WorkerMetrics
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner

PROMPT = 512
BLOCK = 16
SAMPLING = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
WORKER_PARTS = ("parse", "plan_from_proto", "launch", "wait", "result_encode", "metrics")
SCHEDULER_PARTS = ("plan_encode", "result_decode")


class Workload:
    """The scheduler's side: the plans of `rows` decoding requests (block tables grow as needed)."""

    def __init__(self, rows: int, steps: int) -> None:
        self.rows = rows
        per = (PROMPT + BLOCK + steps + 1) // BLOCK + 1
        self.free = iter(range(rows * per))
        self.lengths = [PROMPT + i % BLOCK for i in range(rows)]
        self.blocks = [-(-n // BLOCK) for n in self.lengths]  # blocks held, ceil(n / BLOCK)
        self.step_id = 0

    def prefill(self) -> StepPlan:
        new = tuple(NewRequest(f"req-{i:06d}", tuple(range(3, 3 + n)), SAMPLING,
                               tuple(next(self.free) for _ in range(self.blocks[i])), 0, n)
                    for i, n in enumerate(self.lengths))
        return StepPlan(self._next_id(), new_requests=new)

    def decode(self) -> StepPlan:
        running = []
        for i in range(self.rows):
            self.lengths[i] += 1  # the token sampled last step is this step's (placeholder) input
            grow = ()
            if self.lengths[i] > self.blocks[i] * BLOCK:
                grow, self.blocks[i] = (next(self.free),), self.blocks[i] + 1
            running.append(RunningRequest(f"req-{i:06d}", grow, 1, True))
        return StepPlan(self._next_id(), running=tuple(running))

    def _next_id(self) -> int:
        self.step_id += 1
        return self.step_id


class Clock:
    """Per-part nanoseconds of one step."""

    def __init__(self) -> None:
        self.parts: dict[str, int] = {}
        self._t = time.thread_time_ns()

    def lap(self, part: str) -> None:
        now = time.thread_time_ns()
        self.parts[part] = now - self._t
        self._t = now


def one_step(plan: StepPlan, runner: SimRunner, metrics: WorkerMetrics, clock: Clock):
    """The scheduler's encode, the worker's whole path, the scheduler's decode; returns the result."""
    plan_bytes = scheduler_pb2.SchedulerMessage(plan=codec.plan_to_proto(plan)).SerializeToString()
    clock.lap("plan_encode")
    msg = scheduler_pb2.SchedulerMessage.FromString(plan_bytes)
    received = time.time()
    clock.lap("parse")
    decoded = codec.plan_from_proto(msg.plan)
    clock.lap("plan_from_proto")
    metrics.on_plan(decoded)
    pending = runner.launch(decoded, received)
    clock.lap("launch")
    pending.deadline = 0.0  # the device's time is a sleep (no CPU): not timed here
    result = pending.wait()
    clock.lap("wait")
    result = stamp_sent(result)
    result_bytes = scheduler_pb2.WorkerMessage(result=codec.result_to_proto(result)).SerializeToString()
    clock.lap("result_encode")
    metrics.on_result(result)
    clock.lap("metrics")
    back = codec.result_from_proto(scheduler_pb2.WorkerMessage.FromString(result_bytes).result)
    clock.lap("result_decode")
    return back, len(plan_bytes), len(result_bytes)


def stamp_sent(result):
    """What the daemon's sender thread does before encoding: the `result_sent` timestamp."""
    return dataclasses.replace(result, timing=dataclasses.replace(result.timing, result_sent=time.time()))


def measure(model_dir: Path, rows: int, steps: int, profile: cProfile.Profile | None = None,
            evict_mb: int = 0) -> dict:
    runner = SimRunner(model_dir, load_profile("h200"), num_blocks=rows * ((PROMPT + 2 * BLOCK + steps) // BLOCK + 2),
                       block_size=BLOCK, eos_probability=0.0)
    metrics = WorkerMetrics()
    work = Workload(rows, steps)
    one_step(work.prefill(), runner, metrics, Clock())
    samples: dict[str, list[int]] = {p: [] for p in (*SCHEDULER_PARTS, *WORKER_PARTS)}
    sizes = (0, 0)
    cpu0 = time.process_time()
    evict = (bytearray(evict_mb << 20), bytes(evict_mb << 20)) if evict_mb else None
    for _ in range(steps):
        plan = work.decode()
        if evict:  # the daemon sleeps ~20 ms between steps while other processes run: cold caches
            evict[0][:] = evict[1]
        clock = Clock()
        if profile is not None:
            profile.enable()
        result, *sizes = one_step(plan, runner, metrics, clock)
        if profile is not None:
            profile.disable()
        assert len(result.sampled_token_ids) == rows, "every decode row samples"
        for part, ns in clock.parts.items():
            samples[part].append(ns)
    cpu = time.process_time() - cpu0
    med = {p: statistics.median(v) / 1e3 for p, v in samples.items()}
    worker = sum(med[p] for p in WORKER_PARTS)
    sched = sum(med[p] for p in SCHEDULER_PARTS)
    return {
        "rows": rows, "steps": steps,
        "parts_us": {p: round(v, 1) for p, v in med.items()},
        "worker_us_per_step": round(worker, 1), "worker_us_per_request": round(worker / rows, 2),
        "scheduler_codec_us_per_step": round(sched, 1), "scheduler_codec_us_per_request": round(sched / rows, 2),
        "process_cpu_us_per_step": round(cpu / steps * 1e6, 1),
        "plan_bytes": sizes[0], "result_bytes": sizes[1], "evict_mb": evict_mb,
    }


def print_table(rows: list[dict]) -> None:
    parts = (*WORKER_PARTS, *SCHEDULER_PARTS)
    print(f"{'rows':>5} " + " ".join(f"{p:>15}" for p in parts) + f" {'worker/step':>12} {'worker/req':>10}"
          f" {'sched/step':>11} {'sched/req':>9}")
    for r in rows:
        print(f"{r['rows']:>5} " + " ".join(f"{r['parts_us'][p]:>15.1f}" for p in parts)
              + f" {r['worker_us_per_step']:>12.1f} {r['worker_us_per_request']:>10.2f}"
              f" {r['scheduler_codec_us_per_step']:>11.1f} {r['scheduler_codec_us_per_request']:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--evict-mb", type=int, default=0,
                    help="copy this many MiB between steps (not timed), so each step starts with cold CPU caches, "
                         "as in the daemon; 0: back-to-back steps, warm caches")
    ap.add_argument("--profile-rows", type=int, default=None, help="print a cProfile of the path at this many rows")
    ap.add_argument("--label", default="", help="the run's key in --out (e.g. before / after); other labels are kept")
    ap.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    model_dir = resolve_model("llama3-8b-sim")
    results = [measure(model_dir, rows, args.steps, evict_mb=args.evict_mb) for rows in args.rows]
    print("µs per step (median over steps); per request = per step / rows")
    print_table(results)
    cal = calibration_us()
    print(f"calibration_us (sum(range(10_000))): {cal}")
    if args.profile_rows:
        prof = cProfile.Profile()
        measure(model_dir, args.profile_rows, args.steps, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.out:
        write_run(args.out, args.label or "run", {"calibration_us": cal, "results": results})


def write_run(path: Path, label: str, run: dict) -> None:
    """Runs are kept by label in one file, so before (another checkout, same script) and after
    land side by side: {"runs": {label: {...}}}."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("runs", {})[label] = run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {label} into {path}")


if __name__ == "__main__":
    main()
