"""A worker's Prometheus metrics follow its steps: step and forward time, tokens, failures,
swapped blocks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from stepahead.plan import StepPlan, StepResult, WorkerTiming
from worker_service.metrics import WorkerMetrics


def value(registry: CollectorRegistry, name: str, labels: dict | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


def test_steps_tokens_failures_and_swaps_are_counted():
    registry = CollectorRegistry()
    m = WorkerMetrics(registry)
    m.on_plan(StepPlan(0, swap_out=((1, 2), (3, 4)), swap_in=((5, 6),)))
    timing = WorkerTiming(plan_received=10.0, prep_start=10.001, forward_start=10.002, forward_end=10.012,
                          result_sent=10.013)
    m.on_result(StepResult(0, {"a": 5, "b": 6}, timing, failed={"c": "bad row"}))
    assert value(registry, "stepahead:worker_steps_total") == 1
    assert value(registry, "stepahead:worker_sampled_tokens_total") == 2
    assert value(registry, "stepahead:worker_failed_requests_total") == 1
    assert value(registry, "stepahead:worker_swapped_blocks_total", {"direction": "out"}) == 2
    assert value(registry, "stepahead:worker_swapped_blocks_total", {"direction": "in"}) == 1
    assert abs(value(registry, "stepahead:worker_step_seconds_sum") - 0.013) < 1e-9
    assert abs(value(registry, "stepahead:worker_forward_seconds_sum") - 0.010) < 1e-9


def test_grammar_compile_time_and_cache_hits_and_misses():
    registry = CollectorRegistry()
    m = WorkerMetrics(registry)
    m.on_grammar_cache_miss()
    m.on_grammar_compiled(0.02)
    m.on_grammar_cache_hit()
    m.on_grammar_cache_hit()
    assert value(registry, "stepahead:worker_grammar_cache_misses_total") == 1
    assert value(registry, "stepahead:worker_grammar_cache_hits_total") == 2
    assert value(registry, "stepahead:worker_grammar_compile_seconds_count") == 1
    assert value(registry, "stepahead:worker_grammar_compile_seconds_sum") == 0.02
