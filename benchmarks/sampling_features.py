"""Throughput cost of penalties + logit bias + logprobs on the worker, side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/sampling_features.py --model 100m --batch 32 \
        --out benchmarks/results/sampling_features_100m.json

A `ModelRunner` decodes `--batch` requests for `--steps` steps, four ways, interleaved
(`--rounds` times, so drift on a shared machine hits all alike): plain seeded sampling;
the same with repetition, presence and frequency penalties and an 8-id logit bias on
every row; that plus logprobs (the sampled token's and the top `--logprobs`) on every
row; and all of it on half the rows (what a mixed batch pays). Reports decode tokens/s
(median step time) and the cost relative to plain. `--micro-only` times the added work
alone on random logits (bias + penalties + count update; the logprobs: log-softmax, top-k,
gather, copy to the host and unpacking), which a loaded machine measures more reliably.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from model_zoo.builtin_models import resolve_model
from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
from worker_service.model_runner import ModelRunner

FEATURES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                logit_bias=tuple((t, 2.0) for t in range(100, 108)))


def sampling(i: int, with_features: bool, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    extra = FEATURES if with_features else {}
    return SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens, logprobs=logprobs, **extra)


def decode_step_times(runner: ModelRunner, prompts, featured: set[int], steps: int, block: int,
                      logprobs: int | None = None) -> list[float]:
    runner.reset()
    blocks_per = -(-(len(prompts[0]) + steps + 1) // block)
    new = tuple(
        NewRequest(f"r{i}", tuple(p), sampling(i, i in featured, steps + 1, logprobs if i in featured else None),
                   tuple(range(i * blocks_per, (i + 1) * blocks_per)), 0, len(p), len(p))
        for i, p in enumerate(prompts)
    )
    runner.execute(StepPlan(0, new_requests=new))
    times = []
    for step in range(1, steps + 1):
        plan = StepPlan(step, running=tuple(RunningRequest(f"r{i}", (), 1, True) for i in range(len(prompts))))
        start = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - start)
    runner.execute(StepPlan(steps + 1, finished_ids=tuple(f"r{i}" for i in range(len(prompts)))))
    return times


def logprobs_cost(vocab_size: int, batch: int, k: int, reps: int) -> float:
    """Median ms of the logprob work for `batch` rows asking top `k` (what `StepLogprobs` does
    in a step: raw log-softmax, gather of the sampled ids, top-k, host copy, unpacking)."""
    from worker_service.input_batch import CachedRequest
    from worker_service.logprobs import StepLogprobs

    reqs = [CachedRequest(f"r{i}", [1, 2], sampling(i, False, 8, k), [], 2, 2) for i in range(batch)]
    times = []
    for _ in range(reps):
        logits = torch.randn(batch, vocab_size)
        sampled = torch.randint(0, vocab_size, (batch,))
        t0 = time.perf_counter()
        step = StepLogprobs(torch.device("cpu"), [])
        step.raw(logits, reqs)
        step.sampled(sampled, reqs, reqs)
        step.to_host(pinned=False)
        step.collect({})
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def processing_cost(vocab_size: int, batch: int, reps: int) -> dict:
    """The added work alone, on random logits [batch, vocab]: bias + penalties + count update
    vs. the sampler itself (median ms over `reps`, interleaved); load-robust, unlike steps."""
    from worker_service.logits_processing import LogitsProcessing
    from worker_service.sampler import Sampler, SamplingMetadata

    device = torch.device("cpu")
    rng = random.Random(1)
    processing = LogitsProcessing(vocab_size, device)
    featured = [sampling(i, True, 64) for i in range(batch)]
    for i in range(batch):
        processing.register(f"r{i}", featured[i], [rng.randrange(vocab_size) for _ in range(40)], 32)
    sampler = Sampler(device)
    meta = SamplingMetadata.build(featured, [40] * batch, vocab_size, device)
    ids = [f"r{i}" for i in range(batch)]
    added, sampling_ms = [], []
    for _ in range(reps):
        logits = torch.randn(batch, vocab_size)
        t0 = time.perf_counter()
        processed = processing.apply(logits, ids, featured)
        t1 = time.perf_counter()
        sampled = sampler(processed, meta)
        t2 = time.perf_counter()
        processing.record(sampled)
        t3 = time.perf_counter()
        added.append((t1 - t0) + (t3 - t2))
        sampling_ms.append(t2 - t1)
    return {"bias_penalties_record_ms": round(statistics.median(added) * 1e3, 3),
            "sampler_ms": round(statistics.median(sampling_ms) * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="100m")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--logprobs", type=int, default=20, help="top logprobs per row asking (20: the maximum)")
    parser.add_argument("--micro-only", action="store_true", help="only the per-step added work, no model steps")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    if args.micro_only:
        from worker_service.model_config import ModelConfig

        vocab = ModelConfig.from_dir(model_dir).vocab_size
        micro = processing_cost(vocab, args.batch, reps=50)
        micro[f"logprobs_top{args.logprobs}_ms"] = logprobs_cost(vocab, args.batch, args.logprobs, reps=50)
        print(f"{args.model} vocab, batch {args.batch}: {micro}")
        if args.out:
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "micro": micro},
                                           indent=2))
        return
    blocks = args.batch * (-(-(args.prompt_len + args.steps + 1) // args.block_size))
    runner = ModelRunner(model_dir, block_size=args.block_size, num_blocks=blocks)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, runner.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    every, half = set(range(args.batch)), set(range(0, args.batch, 2))
    configs = {"plain": (set(), None), "penalties+bias, all rows": (every, None),
               "+ logprobs, all rows": (every, args.logprobs), "+ logprobs, half the rows": (half, args.logprobs)}
    samples: dict[str, list[float]] = {name: [] for name in configs}
    decode_step_times(runner, prompts, set(), 4, args.block_size)  # warm-up
    for _ in range(args.rounds):
        for name, (featured, logprobs) in configs.items():
            times = decode_step_times(runner, prompts, featured, args.steps, args.block_size, logprobs)
            samples[name] += times
            print(f"  round: {name:<26} median {statistics.median(times) * 1e3:.1f} ms/step", flush=True)
    base = statistics.median(samples["plain"])
    rows = []
    for name, times in samples.items():
        med = statistics.median(times)
        rows.append({"features": name, "median_step_ms": round(med * 1e3, 2),
                     "decode_tokens_per_s": round(args.batch / med, 1), "cost_vs_plain_pct": round((med / base - 1) * 100, 1)})
    print(f"{args.model}, batch {args.batch}, {args.steps} decode steps x {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}")
    for r in rows:
        print(f"  {r['features']:<26} {r['median_step_ms']:>8} ms/step "
              f"{r['decode_tokens_per_s']:>8} tok/s  {r['cost_vs_plain_pct']:+.1f}%")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
