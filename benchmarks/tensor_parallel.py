"""Tensor parallelism on this machine: per-rank weight memory and decode step time at k = 1, 2.

    python benchmarks/tensor_parallel.py [--model 100m] [--configs 1x1 1x2 2x1] [--batch 8] [--steps 30]
                                         [--out benchmarks/results/tp_cpu_100m.json]

A config `KxT` runs k ranks in k spawned processes (gloo on CPU) with T torch threads each:
`1x2` and `2x1` use the same two cores, one process with two threads vs two processes with
one. Per rank it reports:

- `weight_bytes`: bytes of the rank's parameters (unique storages, tied ones once);
- `load_rss_bytes`: how much the process's resident memory grew while loading them;
- `step_ms`: median wall time of one decode step (`batch` requests, 256 tokens of KV each,
  placeholder inputs, as the scheduler sends them), and `collective_ms`: the part of it spent
  inside torch.distributed calls (all-reduce, gather, broadcast: including waiting for the
  other rank), timed by wrapping those functions.

k = 1 is the single-device `ModelRunner`; k > 1 is `TPModelRunner`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from stepahead.ports import free_port

KV_TOKENS = 256
BLOCK = 16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    return total


class CollectiveClock:
    """Wraps torch.distributed's collectives the model uses; `seconds` accumulates their time."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.seconds = 0.0
        for name in ("all_reduce", "gather", "broadcast"):
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def rank_main(rank: int, size: int, threads: int, port: int, args, out: str) -> None:
    import torch

    torch.set_num_threads(threads)
    from model_zoo.builtin_models import ensure_model
    from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
    from worker_service.loader import load_model, parse_dtype

    path = ensure_model(args.model)
    clock = None
    if size > 1:
        from worker_service.parallel.group import GroupSpec, init_group
        from worker_service.parallel.loader import load_shard

        init_group(GroupSpec("bench", rank, size, "127.0.0.1", port, "gloo", 300))
        before = rss_bytes()
        model, _ = load_shard(path, parse_dtype("float32"), torch.device("cpu"), rank, size)
    else:
        before = rss_bytes()
        model, _ = load_model(path, parse_dtype("float32"), torch.device("cpu"))
    record = {"rank": rank, "weight_bytes": weight_bytes(model), "load_rss_bytes": rss_bytes() - before}
    del model
    per_req = -(-(KV_TOKENS + args.steps + 8) // BLOCK)
    kwargs = dict(block_size=BLOCK, num_blocks=args.batch * per_req, max_model_len=KV_TOKENS + args.steps + 16)
    if size > 1:
        from worker_service.parallel.runner import TPModelRunner

        runner = TPModelRunner(path, rank=rank, size=size, **kwargs)
        clock = CollectiveClock()
    else:
        from worker_service.model_runner import ModelRunner

        runner = ModelRunner(path, **kwargs)
    prompt = tuple(range(1, KV_TOKENS + 2))
    new = tuple(NewRequest(f"r{i}", prompt, SamplingParams(temperature=0.0),
                           tuple(range(i * per_req, (i + 1) * per_req)), KV_TOKENS, 1) for i in range(args.batch))
    runner.execute(StepPlan(0, new_requests=new))
    decode = tuple(RunningRequest(f"r{i}", (), 1, input_is_placeholder=True) for i in range(args.batch))
    steps, collective = [], []
    for step in range(1, args.steps + 1):
        c0, t0 = clock.seconds if clock else 0.0, time.perf_counter()
        runner.execute(StepPlan(step, running=decode))
        steps.append(time.perf_counter() - t0)
        collective.append((clock.seconds if clock else 0.0) - c0)
    warm = args.steps // 5  # the first steps warm caches and allocator
    record["step_ms"] = 1e3 * statistics.median(steps[warm:])
    record["collective_ms"] = 1e3 * statistics.median(collective[warm:])
    Path(f"{out}.{rank}").write_text(json.dumps(record))
    if size > 1:
        from worker_service.parallel.group import destroy_group

        destroy_group()


def run_config(config: str, args, tmp: str) -> list[dict]:
    import torch.multiprocessing as mp

    size, threads = (int(x) for x in config.split("x"))
    out = f"{tmp}.{config}"
    mp.spawn(rank_main, args=(size, threads, free_port(), args, out), nprocs=size, join=True)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(size)]


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="100m")
    parser.add_argument("--configs", nargs="+", default=["1x1", "1x2", "2x1"], help="KxT: k ranks, T threads each")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/tp_cpu_100m.json")
    args = parser.parse_args()
    results = {"model": args.model, "batch": args.batch, "kv_tokens": KV_TOKENS, "steps": args.steps,
               "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()[0], "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            results["configs"][config] = run_config(config, args, f"{tmp}/r")
    results["loadavg_after"] = os.getloadavg()[0]
    print(f"{'KxT':>4} {'rank':>4} {'weights MiB':>12} {'load RSS MiB':>13} {'step ms':>8} {'collectives ms':>15} {'share':>6}")
    for config, ranks in results["configs"].items():
        for r in ranks:
            share = r["collective_ms"] / r["step_ms"] if r["step_ms"] else 0.0
            print(f"{config:>4} {r['rank']:>4} {r['weight_bytes'] / 2**20:>12.1f} {r['load_rss_bytes'] / 2**20:>13.1f} "
                  f"{r['step_ms']:>8.2f} {r['collective_ms']:>15.2f} {share:>6.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
