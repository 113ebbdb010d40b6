"""Each daemon's heap and the garbage collector: the long-lived objects frozen out of full
collections (`freeze_heap`), and the pauses that remain, seen (`GcPauses`: a Prometheus
histogram per generation and a warning for long ones, `--gc-warning-threshold-secs`, SGLang's
flag).

Every collection holds the GIL, so a pause of the scheduler is a step planned late (the
device idles) and a pause of the gateway stalls every stream it serves.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from stepahead import config as cfg

def freeze_heap() -> None:
    """Collect, then take every object alive now out of the collector's full collections: call
    it once a daemon is ready (imports, the model, the tokenizer) and when it builds something
    as long-lived (the scheduler: a replica's KV block pool, an object per block). A full
    collection walks every tracked object with the GIL held (tens of thousands after a daemon's
    imports alone), and under load each one stalled its process in the middle of a step.
    Frozen objects are still freed by reference counting; the collection first means no
    garbage cycle of the moment is frozen for good."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No automatic collection while the `with` block builds objects that `freeze_heap` freezes
    right after (a replica's KV block pool: an object per block, hundreds of thousands on a large
    device). Such a build starts a young collection every few hundred objects, and the middle
    and full collections among them walk everything built so far: hundreds of collections that
    find nothing, with the GIL held, in a process that is serving other replicas meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def gc_warning_threshold_field() -> Any:  # a dataclass field, like `config.field`
    """The `--gc-warning-threshold-secs` flag of every daemon's config."""
    return cfg.field(0.0, "log a warning for a garbage-collection pause this long (0: never; pauses are "
                          "always in /metrics)")


_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class GcPauses:
    """Times every collection of this process from the moment it is created until `close()`."""

    def __init__(self, registry: CollectorRegistry, name: str, log, warning_threshold_s: float = 0.0) -> None:
        if not warning_threshold_s >= 0:  # also refuses NaN
            raise ValueError(f"gc warning threshold must be >= 0 seconds, got {warning_threshold_s}")
        histogram = Histogram(name, "garbage collection pauses (the GIL is held throughout)", ["generation"],
                              registry=registry, buckets=_BUCKETS)
        self._by_generation = [histogram.labels(str(g)) for g in range(3)]
        self._log, self._threshold = log, warning_threshold_s
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        seconds = time.perf_counter() - self._start
        self._by_generation[info["generation"]].observe(seconds)
        if self._threshold and seconds >= self._threshold:
            self._log.warning("gc_pause", generation=info["generation"], seconds=round(seconds, 4),
                              collected=info["collected"], tracked_objects=len(gc.get_objects(info["generation"])))
