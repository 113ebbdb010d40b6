"""Prometheus metrics of the scheduler daemon (served on --metrics-port at /metrics).

The engine calls these hooks from its own thread; prometheus_client is thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler_service.request import Request
from scheduler_service.scheduler import RequestEvent, SchedulerStats
from stepahead.flight_recorder import StepRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
_STEP_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.registry = r
        p = "stepahead_scheduler_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "submit to first committed token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds", "between committed tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "submit to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram(p + "queue_time_seconds", "submit to first scheduled", registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.schedule_time = Histogram(p + "schedule_seconds", "CPU time to plan one step", registry=r,
                                       buckets=_STEP_BUCKETS)
        self.idle_gap = Histogram(p + "device_idle_gap_seconds", "device idle between two steps", registry=r,
                                  buckets=_STEP_BUCKETS)
        self.finished = Counter(p + "requests_finished", "finished requests", ["reason"], registry=r)
        self.workers_attached = Gauge(p + "workers_attached", "replicas attached now", registry=r)
        self.workers_lost = Counter(p + "workers_lost", "replicas dropped (stream broke, bad result, timeout)",
                                    registry=r)
        self.requests_migrated = Counter(p + "requests_migrated", "requests moved off a lost replica", registry=r)
        self.gauges = {
            name: Gauge(p + name, doc, ["replica"], registry=r)
            for name, doc in (
                ("num_running", "requests running"), ("num_waiting", "requests waiting"),
                ("num_swapped", "requests swapped to host"), ("kv_usage", "fraction of device KV blocks in use"),
                ("num_in_flight", "plans in flight"),
            )
        }
        self.totals = {
            name: Gauge(p + name + "_total", doc, ["replica"], registry=r)
            for name, doc in (
                ("prefix_hit_tokens", "prompt tokens served from the prefix cache"),
                ("prefix_query_tokens", "prompt tokens looked up in the prefix cache"),
                ("num_preemptions", "preemptions"), ("num_steps", "steps"),
            )
        }
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self._last_forward_end: dict[str, float] = {}  # per replica

    def on_submit(self, request_id: str) -> None:
        self._arrival[request_id] = time.monotonic()

    def forget(self, request_id: str) -> None:
        """The request ended without an event the metrics see (refused after waiting)."""
        self._arrival.pop(request_id, None)
        self._last_token.pop(request_id, None)

    def on_replica_lost(self, replica: str, num_moved: int, num_left: int) -> None:
        self.workers_lost.inc()
        self.requests_migrated.inc(num_moved)
        self.workers_attached.set(num_left)
        self._last_forward_end.pop(replica, None)
        for gauge in (*self.gauges.values(), *self.totals.values()):
            try:
                gauge.remove(replica)
            except KeyError:  # that replica never finished a step
                pass

    def on_events(self, events: list[RequestEvent], lookup: Callable[[str], Request | None]) -> None:
        now = time.monotonic()
        for e in events:
            arrival = self._arrival.get(e.request_id)
            if arrival is None:
                continue
            if e.new_token_ids:
                last = self._last_token.get(e.request_id)
                if last is None:
                    self.ttft.observe(now - arrival)
                    self._observe_queue_time(lookup(e.request_id))
                else:
                    self.itl.observe((now - last) / len(e.new_token_ids))
                self._last_token[e.request_id] = now
            if e.finish_reason is not None:
                self.e2e.observe(now - arrival)
                self.finished.labels(e.finish_reason.name.lower()).inc()
                self._arrival.pop(e.request_id, None)
                self._last_token.pop(e.request_id, None)

    def _observe_queue_time(self, request: Request | None) -> None:
        if request is not None and request.first_scheduled_time is not None and request.arrival_time is not None:
            self.queue.observe(request.first_scheduled_time - request.arrival_time)

    def on_step(self, record: StepRecord, stats: SchedulerStats, replica: str = "") -> None:
        self.schedule_time.observe(record.schedule_end - record.schedule_start)
        last_end = self._last_forward_end.get(replica, 0.0)
        if record.worker.forward_start and last_end:
            self.idle_gap.observe(max(0.0, record.worker.forward_start - last_end))
        self._last_forward_end[replica] = record.worker.forward_end or last_end
        for name, gauge in self.gauges.items():
            gauge.labels(replica).set(getattr(stats, name))
        for name, gauge in self.totals.items():
            gauge.labels(replica).set(getattr(stats, name))
