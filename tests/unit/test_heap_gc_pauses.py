"""A daemon's garbage-collection pauses: counted per generation, long ones logged."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry
import structlog

from stepahead.heap import GcPauses


def count(registry: CollectorRegistry, generation: int) -> float:
    return registry.get_sample_value("t_gc_pause_seconds_count", {"generation": str(generation)}) or 0.0


def test_each_collection_is_timed_in_its_generation_until_closed():
    registry = CollectorRegistry()
    pauses = GcPauses(registry, "t_gc_pause_seconds", structlog.get_logger())
    try:
        gc.collect(2)
        gc.collect(0)
        assert count(registry, 2) >= 1 and count(registry, 0) >= 1
        assert registry.get_sample_value("t_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        pauses.close()
    before = count(registry, 2)
    gc.collect(2)
    assert count(registry, 2) == before, "closed: no longer observed"


def test_a_pause_past_the_threshold_is_a_warning_naming_its_generation():
    records = []  # a logger of its own: the process-wide structlog config may filter warnings (a test sets "error")

    def collect(_, method, event_dict):
        records.append((method, event_dict))
        raise structlog.DropEvent

    log = structlog.wrap_logger(None, processors=[collect], wrapper_class=structlog.BoundLogger)
    pauses = GcPauses(CollectorRegistry(), "t_gc_pause_seconds", log, warning_threshold_s=1e-9)
    try:
        gc.collect(1)
    finally:
        pauses.close()
    warnings = [(method, e) for method, e in records if e["event"] == "gc_pause"]
    assert warnings and warnings[0][0] == "warning" and warnings[0][1]["generation"] == 1


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_threshold_is_refused(bad):
    with pytest.raises(ValueError, match="threshold"):
        GcPauses(CollectorRegistry(), "t_gc_pause_seconds", structlog.get_logger(), warning_threshold_s=bad)
