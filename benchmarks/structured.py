"""The cost of structured outputs per decode step at batch 32 (JSON schema vs free text).

    python benchmarks/structured.py [--model tiny 100m] [--batch 32] [--requests 64] [--device cpu]
                                    [--threads N] [--out-dir benchmarks/results]

One process, the real scheduler core and the real ModelRunner, driven as the worker daemon
drives it under async scheduling: step t+1 is launched before step t's sampled ids are read
(so a grammar row's previous token is a placeholder and the mask waits for it). Two runs
side by side on the same prompts and seeds, `--batch` requests at a time: free text
(`ignore_eos`, as long as the JSON run's mean output) and a JSON schema (nested object,
enum, array, bounded numbers). Per step (batch-full decode steps only):

- `step_ms`: wall time per step (launch to launch), the throughput view;
- `mask_build_ms`: host time to advance the matchers and fill the bitmask (`GrammarMasks`),
  including the H2D of the bitmask and queueing the masking;
- `mask_wait_ms`: host time spent waiting for the previous step's ids before building;
- `forward_ms` (free-text run): launch time of a step without any grammar row.

On CPU the forward runs synchronously inside `launch`, so nothing can be hidden: the mask
build adds to the step. On CUDA the forward is queued before the mask is built; the mask
build is hidden when `mask_build_ms` < the device's forward time, which shows as
`step_ms` (JSON) ~= `step_ms` (free text). Writes `structured_<model>_<device>.json`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time
from pathlib import Path

from testing.structured import SCHEMA


def run_once(runner, config, prompts, samplings) -> dict:
    """Launch-ahead loop over the real scheduler core; returns per-step samples."""
    from scheduler_service.core.request import Request
    from scheduler_service.core.scheduler import Scheduler
    from scheduler_service.step_loop import StepLoop

    runner.reset()
    scheduler = Scheduler(config)
    loop = StepLoop(scheduler)
    for i, (p, s) in enumerate(zip(prompts, samplings)):
        scheduler.add_request(Request(f"r{i}", p, s))
    launched: collections.deque = collections.deque()
    samples, outputs = [], collections.Counter()
    last = time.perf_counter()
    while scheduler.has_unfinished_requests() or loop.num_in_flight:
        for plan in loop.plan_ahead():
            runner.grammar.last_build_s = runner.grammar.last_wait_s = 0.0
            start = time.perf_counter()
            launched.append(runner.launch(plan))
            launch_s = time.perf_counter() - start
            now = time.perf_counter()
            full = plan.num_requests == plan.num_scheduled_tokens == config.max_num_seqs  # decodes only
            if full:
                samples.append((now - last, launch_s, runner.grammar.last_build_s, runner.grammar.last_wait_s))
            last = now
        if not loop.num_in_flight:
            continue
        _, events = loop.commit(launched.popleft().wait())
        for e in events:
            outputs[e.request_id] += len(e.new_token_ids)
    return {"samples": samples, "mean_output_tokens": statistics.mean(outputs.values())}


def summarise(samples) -> dict:
    def ms(col):
        return round(1e3 * statistics.median(s[col] for s in samples), 3) if samples else None

    return {"steps": len(samples), "step_ms": ms(0), "launch_ms": ms(1), "mask_build_ms": ms(2), "mask_wait_ms": ms(3)}


def bench(model: str, device: str, batch: int, num_requests: int) -> dict:
    from transformers import AutoTokenizer

    from scheduler_service.core.config import SchedulerConfig
    from model_zoo.builtin_models import ensure_model
    from stepahead.plan import SamplingParams, StructuredKind, StructuredOutput
    from worker_service.model_runner import ModelRunner

    model_dir = ensure_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runner = ModelRunner(model_dir, device=device, block_size=16, num_blocks=batch * 16, max_num_seqs=batch)
    config = SchedulerConfig(num_gpu_blocks=batch * 16, num_cpu_blocks=0, max_model_len=runner.max_model_len,
                             block_size=16, max_num_seqs=batch, max_num_batched_tokens=4096, async_scheduling=True,
                             eos_token_ids=runner.eos_token_ids)
    prompts = [tokenizer.encode(f"Describe pet number {i} as JSON:") for i in range(num_requests)]
    structured = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
    start = time.perf_counter()
    runner.grammar.cache.get(structured)  # xgrammar import + tokenizer info + first compile
    first_compile_s = time.perf_counter() - start
    json_run = run_once(runner, config, prompts, [
        SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured=structured) for i in range(num_requests)])
    length = max(1, round(json_run["mean_output_tokens"]))
    free_run = run_once(runner, config, prompts, [
        SamplingParams(temperature=1.0, seed=i, max_tokens=length, ignore_eos=True) for i in range(num_requests)])
    free, constrained = summarise(free_run["samples"]), summarise(json_run["samples"])
    overhead = (constrained["step_ms"] / free["step_ms"] - 1.0) if free["step_ms"] and constrained["step_ms"] else None
    return {
        "model": model, "device": device, "batch": batch, "requests": num_requests,
        "mean_output_tokens": round(json_run["mean_output_tokens"], 1),
        "first_compile_s": round(first_compile_s, 3), "free_text": free, "json_schema": constrained,
        "step_overhead": None if overhead is None else round(overhead, 3),
        "hidden": device.startswith("cuda") and overhead is not None and overhead < 0.05,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["tiny", "100m"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    for model in args.model:
        result = bench(model, args.device, args.batch, args.requests)
        result |= {"torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
                   "load_average_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
        out = Path(args.out_dir) / f"structured_{model}_{args.device.replace(':', '')}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
