"""The scheduler's heap against the garbage collector, measured in a fresh interpreter each time
(freezing is process-wide): what `tests/unit/test_heap_freeze.py` asserts and
`benchmarks/experiments/scheduler_gc.py` reports.

- `attach(num_blocks)`: a replica with a pool of `num_blocks` blocks attaches to an engine
  that freezes its heap (as the daemon's does); the time from hello to acceptance, the
  collections that started meanwhile (young, middle, full) and the objects frozen.
- `warm_cache(num_blocks)`: a frozen pool whose every block holds a cached content; one full
  collection's time (best of 5) and the objects the collector still tracks.
"""

from __future__ import annotations

import json
import subprocess
import sys

_ATTACH = """
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
info = WorkerInfo("w0", "m", "llama", "bfloat16", "sim", 16, {num_blocks}, 0, 4096, 1000, (0,))
before, start = list(counts), time.perf_counter()
engine.attach_worker(info, outbox)
threading.Thread(target=lambda: list(outbox), daemon=True).start()  # the stream writer's part
assert accepted.get(timeout=120)
engine.stats()  # a round trip through the engine's loop: the attach is complete
print(json.dumps({{"attach_ms": (time.perf_counter() - start) * 1e3,
                   "collections": [a - b for a, b in zip(counts, before)], "frozen": gc.get_freeze_count()}}))
engine.stop()
"""

_WARM_CACHE = """
import gc, json, time
from scheduler_service.core.block_pool import BlockPool
from stepahead.heap import freeze_heap
pool = BlockPool({num_blocks}, enable_caching=True)
freeze_heap()  # as the daemon does when a replica attaches
blocks = pool.allocate({num_blocks})
parent = 0
for i, block in enumerate(blocks):  # every block holds a cached content
    parent = pool.register(block, hash((parent, i)), tuple(range(i, i + 16)), None, parent if i % 64 else 0)
pool.free(blocks, touch_step=-1)
assert pool.num_cached == {num_blocks}
gc.collect()
def once():
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start
print(json.dumps({{"full_collection_ms": min(once() for _ in range(5)) * 1e3,
                   "tracked_objects": len(gc.get_objects())}}))
"""


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def attach(num_blocks: int) -> dict:
    return _run(_ATTACH.format(num_blocks=num_blocks))


def warm_cache(num_blocks: int) -> dict:
    return _run(_WARM_CACHE.format(num_blocks=num_blocks))
