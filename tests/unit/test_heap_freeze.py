"""Daemons take their long-lived objects out of the garbage collector's walks.

A full collection walks every tracked object with the GIL held; at 256 streams the
scheduler's KV block pool (an object per block) and each daemon's ~50k import-time objects
made every full collection stall a step by 50-130 ms. Each check runs in its own
interpreter: freezing is process-wide and would change the test process's collector.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from testing import scheduler_heap

FREEZE_HEAP = """
import gc
from stepahead.heap import freeze_heap
before = len(gc.get_objects())
freeze_heap()
assert gc.get_freeze_count() >= 0.9 * before, (gc.get_freeze_count(), before)
assert len(gc.get_objects()) < 0.05 * before, len(gc.get_objects())
"""

ATTACH = """
import gc, queue, threading, weakref
import structlog
from scheduler_service.engine import Engine, EngineOptions, PlanOutbox
from scheduler_service.server import SchedulerDaemonConfig
from stepahead.plan import WorkerInfo

class Node:
    pass


gc.disable()  # nothing collects the cycle below unless the attach does
node = Node()
node.me = node
garbage = weakref.ref(node)
del node
accepted = queue.Queue()
engine = Engine(SchedulerDaemonConfig().core_config, structlog.get_logger(),
                options=EngineOptions(freeze_heap_on_attach={freeze}))
engine.start()
outbox = PlanOutbox(on_accept=lambda: accepted.put(True))
info = WorkerInfo("w0", "m", "llama", "bfloat16", "sim", 16, 20000, 0, 4096, 1000, (0,))
engine.attach_worker(info, outbox)
threading.Thread(target=lambda: list(outbox), daemon=True).start()  # the stream writer's part
assert accepted.get(timeout=30)
engine.stats()  # a round trip through the engine thread: the attach is complete
frozen = gc.get_freeze_count()
assert (frozen >= 20000) == {freeze}, frozen  # 20000 blocks: one tracked object each
assert (garbage() is None) == {freeze}, "a garbage cycle of the moment would be frozen for good"
engine.stop()
"""


def run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_freeze_heap_moves_every_live_object_out_of_collections():
    run(FREEZE_HEAP)


@pytest.mark.parametrize("freeze", [True, False])
def test_a_replicas_block_pool_is_frozen_only_when_the_daemon_owns_the_process(freeze):
    run(ATTACH.format(freeze=freeze))


def test_building_a_large_block_pool_starts_no_collections_before_it_is_frozen():
    out = scheduler_heap.attach(200_000)
    assert out["frozen"] >= 200_000
    # freeze_heap's own collection (a full one) and, at most, a few young ones around the build;
    # building the 200,000 blocks with collections on starts hundreds of young ones
    assert out["collections"][0] <= 10 and out["collections"][2] <= 2, out


def test_a_warm_prefix_cache_adds_nothing_for_full_collections_to_walk():
    out = scheduler_heap.warm_cache(20_000)
    assert out["tracked_objects"] < 1000, out  # what a full collection walks
