"""What the garbage collector costs the scheduler daemon around its KV block pool.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/scheduler_gc.py [--blocks 236000] [--rounds 3]

Two numbers, each in a fresh interpreter per round (freezing is process-wide), as the daemon
runs (`freeze_heap_on_attach`):
- attach: a worker's hello to its acceptance by the engine with a pool of `--blocks` blocks
  (236,000 is llama3.2-1b-sim on the h200 profile), and the collections that started meanwhile
  (young, middle, full). The engine's loop, which runs every replica's steps, waits throughout.
- full collection: `gc.collect()` once every block of that pool holds a cached content (a warm
  prefix cache), best of 5: what every full collection of a long-running scheduler walks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ATTACH = """
import gc, json, queue, threading, time
import structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
from scheduler_service.engine import Engine, EngineOptions, PlanOutbox
from scheduler_service.server import SchedulerDaemonConfig
from stepahead.plan import WorkerInfo
counts = [0, 0, 0]
gc.callbacks.append(lambda phase, info: phase == "start" and counts.__setitem__(
    info["generation"], counts[info["generation"]] + 1))
accepted = queue.Queue()
engine = Engine(SchedulerDaemonConfig().core_config, structlog.get_logger(),
                options=EngineOptions(freeze_heap_on_attach=True))
engine.start()
outbox = PlanOutbox(on_accept=lambda: accepted.put(True))
info = WorkerInfo("w0", "m", "llama", "bfloat16", "sim", 16, {blocks}, 0, 4096, 1000, (0,))
start = time.perf_counter()
engine.attach_worker(info, outbox)
threading.Thread(target=lambda: list(outbox), daemon=True).start()
accepted.get(timeout=120)
engine.stats()
print(json.dumps({{"attach_ms": (time.perf_counter() - start) * 1e3, "collections": counts}}))
engine.stop()
"""

WARM = """
import gc, json, time
from scheduler_service.core.block_pool import BlockPool
from stepahead.heap import freeze_heap
pool = BlockPool({blocks}, enable_caching=True)
freeze_heap()
blocks = pool.allocate({blocks})
parent = 0
for i, block in enumerate(blocks):
    parent = pool.register(block, hash((parent, i)), tuple(range(i, i + 16)), None, parent if i % 64 else 0)
pool.free(blocks, touch_step=-1)
gc.collect()
def once():
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start
print(json.dumps({{"full_collection_ms": min(once() for _ in range(5)) * 1e3,
                   "tracked_objects": len(gc.get_objects())}}))
"""


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=236_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for r in range(args.rounds):
        attach, warm = run(ATTACH.format(blocks=args.blocks)), run(WARM.format(blocks=args.blocks))
        print(f"round {r}: attach {attach['attach_ms']:.0f} ms, collections meanwhile (young, middle, full) "
              f"{attach['collections']}; full collection with a warm cache {warm['full_collection_ms']:.1f} ms, "
              f"{warm['tracked_objects']} objects tracked", flush=True)


if __name__ == "__main__":
    main()
