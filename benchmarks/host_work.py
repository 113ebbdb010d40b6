"""Host work per decode step on the worker, at 64 / 256 / 1024 rows: what a GPU waits for.

    python benchmarks/host_work.py [--rows 64 256 1024] [--iters 200] [--out benchmarks/results/host_work.json]

Every part of `ModelRunner.launch` that runs on the host before the device can start
the step, timed alone (minimum of `--iters` runs, microseconds), with no device work:

- `check_plan`: validation of the plan against the worker's state;
- `schedule`: applying the plan's deltas (`_schedule`);
- `build_inputs`: filling the persistent arena (on CPU the host arena *is* the device
  arena, so no copy is timed);
- `sampling_greedy` / `sampling_mixed`: `SamplingMetadata.build` for all-greedy rows and
  for half greedy, half seeded top-p rows, as the runner calls it (rows validated at
  admission; its host packing; the H2D is not timed);
- `min_tokens`: the stop-id mask when no live request has `min_tokens` (the usual case);
- `total_greedy` / `total_mixed`: the sum.

`calibration_us` (in the JSON and the last line) times `sum(range(10_000))` the same way, so
numbers from machines of different speed or load can be compared.

The plan is a decode step of `rows` running requests (placeholder inputs, ~256 tokens of
KV each, 1 in 16 getting a new block), as in steady-state serving. Target: total <= 300 us
at 256 rows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan

KV_TOKENS = 256
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=1 << 20)


def build_runner(max_rows: int):
    from testing.checkpoints import build_checkpoint
    from worker_service.model_runner import ModelRunner

    path = Path(tempfile.mkdtemp(prefix="host-work-"))
    build_checkpoint(path, "llama", num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    blocks_per_req = KV_TOKENS // BLOCK + 2
    return ModelRunner(path, block_size=BLOCK, num_blocks=max_rows * blocks_per_req, max_num_seqs=max_rows)


def setup(runner, rows: int) -> list[StepPlan]:
    """Registers `rows` requests as prefix hits; returns decode plans (each used once per iter)."""
    runner.reset()
    per = KV_TOKENS // BLOCK + 2
    new = [NewRequest(f"r{i}", tuple(range(KV_TOKENS)), GREEDY if i % 2 else SAMPLED,
                      tuple(range(i * per, i * per + per - 1)), KV_TOKENS - 1, 1) for i in range(rows)]
    sched = runner._schedule(tuple(new), ())
    for state in sched.states:
        state.token_ids.append(0)  # a sampled token, as after the first step
        state.num_computed = KV_TOKENS
    runner._prev_rows = {f"r{i}": i for i in range(rows)}
    runner._prev_sampled = torch.zeros(rows, dtype=torch.int64)
    running = tuple(RunningRequest(f"r{i}", (), 1, True) for i in range(rows))
    return [StepPlan(1, running=running)]


def time_us(fn, iters: int) -> float:
    """The minimum over `iters` runs: on a shared machine the median mostly measures the load."""
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return min(samples)


def measure(runner, rows: int, iters: int) -> dict[str, float]:
    from worker_service.input_batch import BuildConfig, build_inputs
    from worker_service.plan_checks import check_plan
    from worker_service.sampler import SamplingMetadata

    (plan,) = setup(runner, rows)
    reqs = [runner.requests[f"r{i}"] for i in range(rows)]
    cfg = BuildConfig(runner.block_size, runner.kv_cache.dummy_block, pad_decodes=True)

    def check():
        check_plan(plan, runner.requests, runner._prev_rows, num_blocks=runner.num_blocks,
                   block_size=runner.block_size, max_model_len=runner.max_model_len, vocab_size=runner.vocab_size)

    sched = runner._schedule((), plan.running)

    def build():
        build_inputs(runner.buffers[0], runner.table, sched, cfg, runner._prev_rows)

    greedy = [GREEDY] * rows
    mixed = [r.sampling for r in reqs]
    counts = [len(r.token_ids) for r in reqs]
    logits = torch.zeros(rows, runner.vocab_size)
    out = {
        "check_plan": time_us(check, iters),
        "schedule": time_us(lambda: runner._schedule((), plan.running), iters),
        "build_inputs": time_us(build, iters),
        "sampling_greedy": time_us(lambda: SamplingMetadata.build(greedy, counts, runner.vocab_size,
                                                                  runner.device, validated=True), iters),
        "sampling_mixed": time_us(lambda: SamplingMetadata.build(mixed, counts, runner.vocab_size,
                                                                 runner.device, validated=True), iters),
        "min_tokens": time_us(lambda: runner._mask_stops_before_min_tokens(logits, reqs), iters),
    }
    base = out["check_plan"] + out["schedule"] + out["build_inputs"] + out["min_tokens"]
    out["total_greedy"] = base + out["sampling_greedy"]
    out["total_mixed"] = base + out["sampling_mixed"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/host_work.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runner = build_runner(max(args.rows))
    results = {}
    for rows in args.rows:
        results[rows] = measure(runner, rows, args.iters)
    calibration = time_us(lambda: sum(range(10_000)), args.iters)
    cols = list(next(iter(results.values())))
    print("rows  " + "  ".join(f"{c:>15}" for c in cols) + "   (min us per step)")
    for rows, r in results.items():
        print(f"{rows:<5} " + "  ".join(f"{r[c]:15.1f}" for c in cols))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print(f"calibration: sum(range(10_000)) takes {calibration:.1f} us here")
    Path(args.out).write_text(json.dumps({"iters": args.iters, "kv_tokens": KV_TOKENS, "calibration_us": calibration,
                                          "rows": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
