"""KV transfer between two torch workers' runners on this machine: time per block and MB/s.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_transfer.py [--model smollm2-135m] \
        [--blocks 1 16 64 256] [--repeats 5] [--out benchmarks/results/kv_transfer_smollm2-135m.json]

A source runner serves its KV blocks on a real KVTransfer server on 127.0.0.1 (cluster token
on, as a deployment runs it); a destination runner's `KVLoader` loads N of them into its own
blocks, as a decode worker does for a disaggregated request (ReadBlocks streamed in ~4 MiB
chunks, checked, written into the destination's KV cache). Reported per N: the wall time from
the load's start to its report (median of the repeats), per block, and the bytes moved per
second. No GPU: on CPU a load is a memory copy through a loopback socket.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time
from pathlib import Path

import structlog

from benchmarks.machine import python_speed_ms
from model_zoo.builtin_models import resolve_model
from stepahead.plan import KVLoad, StepPlan, WorkerRole
from worker_service.config import WorkerConfig
from worker_service.kv_loads import KVLoader
from worker_service.kv_transfer import KVTransferServer
from worker_service.model_runner import ModelRunner

TOKEN = "bench-token"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    log = structlog.get_logger("kv_transfer_bench")
    model_dir = resolve_model(args.model)
    pool = 2 * max(args.blocks)
    src = ModelRunner(model_dir, num_blocks=pool, block_size=args.block_size, max_model_len=pool * args.block_size)
    dst = ModelRunner(model_dir, num_blocks=pool, block_size=args.block_size, max_model_len=pool * args.block_size)
    config = WorkerConfig(role=WorkerRole.PREFILL, cluster_token=TOKEN)
    server = KVTransferServer(config, log)
    server.serve(src)
    reports: queue.SimpleQueue = queue.SimpleQueue()
    loader = KVLoader(dst, config.scheduler_channel, 120.0, reports.put, log)
    dst.kv_loader = loader
    rows, step = [], 0
    try:
        speed = python_speed_ms()
        for n in args.blocks:
            times = []
            for _ in range(args.repeats + 1):  # the first opens the channel: not counted
                step += 1
                load = KVLoad(step, server.address, tuple(range(n)), tuple(range(pool - n, pool)), server.instance)
                start = time.perf_counter()
                dst.execute(StepPlan(step, kv_loads=(load,)))
                report = reports.get(timeout=120)
                times.append(time.perf_counter() - start)
                assert not report.error, report.error
            wall = statistics.median(times[1:])
            nbytes = n * dst.kv_bytes_per_block
            rows.append({"blocks": n, "tokens": n * args.block_size, "bytes": nbytes, "median_s": wall,
                         "ms_per_block": wall * 1e3 / n, "mb_per_s": nbytes / wall / 1e6})
            print(f"{n:5d} blocks ({nbytes / 2**20:7.2f} MiB): {wall * 1e3:8.2f} ms, "
                  f"{wall * 1e3 / n:6.3f} ms/block, {nbytes / wall / 1e6:7.0f} MB/s")
    finally:
        dst.kv_loader = None
        loader.close()
        server.close()
    result = {"model": args.model, "block_size": args.block_size, "bytes_per_block": dst.kv_bytes_per_block,
              "dtype": str(dst.dtype) if hasattr(dst, "dtype") else None, "python_speed_ms": speed, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
