"""Prometheus metrics of the scheduler daemon (served on --metrics-port at /metrics).

Names follow vLLM's `vllm:*` set under `stepahead:` where the concept is the same; gauges
carry no `_total`. Per-replica gauges and counters carry a `replica` label (the worker id):
`sum(stepahead:prefix_cache_hits_total)` is the scheduler's total, one series a replica's
own. The per-replica gauges and counters are read when /metrics is scraped, never per step
(`ReplicaStatsCollector`: one snapshot of every replica core, taken on the engine's loop);
counters come from each core's monotonic counters plus those of earlier cores under the same
replica name (a lost replica's gauges go, its counter series stay: totals never go back).
The engine calls the hooks below from its own thread; prometheus_client is thread-safe.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable, Mapping

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from scheduler_service.core.events import PlainTokenEvent, PlainTokens, RequestEvent, StepEvents
from scheduler_service.core.scheduler import SchedulerStats
from scheduler_service.token_times import LastTokenTimes
from stepahead.flight_recorder import StepRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
_STEP_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
P = "stepahead:"

# stats field -> (gauge name, help)
_GAUGES = {
    "num_running": ("num_requests_running", "requests running"),
    "num_waiting": ("num_requests_waiting", "requests waiting (incl. preempted)"),
    "num_swapped": ("num_requests_swapped", "requests whose KV is in host memory"),
    "kv_usage": ("kv_cache_usage_perc", "fraction of device KV blocks in use"),
    "num_in_flight": ("scheduler_plans_in_flight", "plans sent whose result has not arrived"),
}
# stats field -> (counter name without _total, help)
_COUNTERS = {
    "prefix_hit_tokens": ("prefix_cache_hits", "prompt tokens served from the prefix cache"),
    "prefix_query_tokens": ("prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
    "num_preemptions": ("num_preemptions", "preemptions"),
    "num_steps": ("scheduler_steps", "steps committed"),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "speculative decoding: draft tokens verified"),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "speculative decoding: draft tokens accepted"),
    "num_slid_blocks": ("kv_blocks_slid", "KV blocks freed once every layer's sliding window had passed them"),
    "prefix_host_hit_tokens": ("prefix_cache_host_hits", "prompt tokens loaded from the prefix cache's host tier"),
    "num_offloaded_blocks": ("kv_offloaded_blocks", "evicted device KV blocks copied to the prefix cache's host tier"),
    "num_host_evictions": ("kv_host_cache_evictions", "cached host KV blocks dropped to make room"),
    "num_handoffs": ("kv_transfer_handoffs", "requests a prefill replica handed to a decode replica"),
    "num_loaded_blocks": ("kv_transfer_loaded_blocks", "KV blocks decode replicas loaded from prefill replicas"),
    "num_failed_loads": ("kv_transfer_failed_loads", "KV loads that failed (the request was computed again)"),
}


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.ttft = Histogram(P + "time_to_first_token_seconds", "submit to first committed token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = HotHistogram(P + "inter_token_latency_seconds", "between committed tokens", _LATENCY_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "submit to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram(P + "request_queue_time_seconds", "submit to first scheduled", registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.schedule_time = Histogram(P + "scheduler_schedule_seconds", "CPU time to plan one step", registry=r,
                                       buckets=_STEP_BUCKETS)
        self.idle_gap = Histogram(P + "device_idle_gap_seconds", "device idle between two steps", registry=r,
                                  buckets=_STEP_BUCKETS)
        self.finished = Counter(P + "request_finished", "finished requests", ["finished_reason"], registry=r)
        self.late_plans = Counter(P + "late_plans", "steps the device waited for although their plan was made as "
                                  "soon as the in-flight window allowed: the control plane is the bottleneck",
                                  ["replica"], registry=r)
        self.concurrent_batches = Gauge(P + "concurrent_batches", "plans a replica keeps in flight now (the async "
                                        "window; adaptive: deeper while its plans are late)", ["replica"], registry=r)
        self.workers_lost = Counter(P + "workers_lost", "workers lost (stream broken, failed, dropped)", registry=r)
        self.workers_attached = Gauge(P + "workers_attached", "replicas (workers) attached now", registry=r)
        self.requests_migrated = Counter(P + "requests_migrated", "requests moved off a lost or leaving replica",
                                         registry=r)
        self.internal_auth_refused = Counter(
            P + "internal_auth_refused", "internal-plane calls refused for a missing or wrong cluster token",
            ["daemon", "method"], registry=r)
        self._arrival: dict[str, float] = {}
        self._last_token = LastTokenTimes()

    def on_submit(self, request_id: str) -> None:
        self._arrival[request_id] = time.monotonic()

    def on_events(self, events: list[RequestEvent]) -> None:
        now, last_token, observe = time.monotonic(), self._last_token, self.itl.observe_many
        gaps = []  # the decode events' inter-token latencies, observed in one call
        for e in events:
            rid = e.request_id
            last = last_token.get(rid)
            if last is not None and e.new_token_ids and e.finish_reason is None and e.queue_time is None:
                gaps.append((now - last) / len(e.new_token_ids))
                last_token.set(rid, now)
            else:
                self._on_event(e, now)
        observe(gaps)

    def on_step_events(self, step: StepEvents) -> None:
        self.on_events(step.events)
        self.on_plain(step.plain)

    def on_plain(self, plain: PlainTokens) -> None:
        """A step's plain tokens: one inter-token latency each, in bulk (the hot path)."""
        if not plain.request_ids:
            return
        now = time.monotonic()
        gaps, unseen = self._last_token.plain_step(plain.request_ids, now)
        if isinstance(gaps, float):
            self.itl.observe_n(gaps, len(plain.request_ids))
            return
        if unseen:  # requests whose first token the metrics did not see: each as its own event
            for rid, token in zip(plain.request_ids, plain.token_ids):
                if rid in unseen:
                    self._on_event(PlainTokenEvent(rid, token), now)
            gaps = gaps[~np.isnan(gaps)]
        self.itl.observe_array(gaps)

    def _on_event(self, e: RequestEvent, now: float) -> None:
        arrival = self._arrival.get(e.request_id)
        if arrival is None:
            return
        if e.new_token_ids:
            last = self._last_token.get(e.request_id)
            if last is None:
                self.ttft.observe(now - arrival)
            else:
                self.itl.observe((now - last) / len(e.new_token_ids))
            self._last_token.set(e.request_id, now)
        if e.queue_time is not None:
            self.queue.observe(e.queue_time)
        if e.finish_reason is not None:
            self.e2e.observe(now - arrival)
            self.finished.labels(e.finish_reason.name.lower()).inc()
            self._arrival.pop(e.request_id, None)
            self._last_token.pop(e.request_id)

    def forget(self, request_id: str) -> None:
        """The request ended without an event the metrics see (refused after waiting)."""
        self._arrival.pop(request_id, None)
        self._last_token.pop(request_id)

    def on_step(self, record: StepRecord) -> None:
        self.schedule_time.observe(record.schedule_end - record.schedule_start)

    def on_window(self, replica: str, size: int, idle_s: float | None, late: bool) -> None:
        """After a committed step (`StepLoop` judged it): the replica's window, how long the device
        sat idle before that step (None: unknown), and whether its plan was late."""
        if idle_s is not None:
            self.idle_gap.observe(max(0.0, idle_s))
        self.concurrent_batches.labels(replica).set(size)
        if late:
            self.late_plans.labels(replica).inc()

    def watch_replicas(self, snapshot: Callable[[], ReplicaSnapshot]) -> None:
        """Serve the per-replica gauges and counters from `snapshot()` at scrape time."""
        self.registry.register(ReplicaStatsCollector(snapshot))

    def on_replica_attached(self, num_replicas: int) -> None:
        self.workers_attached.set(num_replicas)

    def on_replica_lost(self, replica: str, num_moved: int, num_left: int, lost: bool = True) -> None:
        """`lost`: it failed (not a worker leaving by itself)."""
        if lost:
            self.workers_lost.inc()
        self.requests_migrated.inc(num_moved)
        self.workers_attached.set(num_left)
        self.concurrent_batches.remove(replica)  # its gauge goes (its late_plans series stays: a counter)


# (each attached replica's stats by name, the monotonic counters of earlier cores by replica name)
ReplicaSnapshot = tuple[Mapping[str, SchedulerStats], Mapping[str, collections.Counter]]


class ReplicaStatsCollector:
    """The `replica`-labelled gauges and counters, built from one snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], ReplicaSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self):
        gauges, counters = self._families()
        return [*gauges.values(), *counters.values()]

    @staticmethod
    def _families() -> tuple[dict[str, GaugeMetricFamily], dict[str, CounterMetricFamily]]:
        return ({f: GaugeMetricFamily(P + name, doc, labels=["replica"]) for f, (name, doc) in _GAUGES.items()},
                {f: CounterMetricFamily(P + name, doc, labels=["replica"]) for f, (name, doc) in _COUNTERS.items()})

    def collect(self):
        live, earlier = self._snapshot()
        gauges, counters = self._families()
        for field, family in gauges.items():
            for replica, stats in live.items():
                family.add_metric([replica], getattr(stats, field))
        for field, family in counters.items():
            for replica in {**earlier, **live}:
                now = getattr(live[replica], field) if replica in live else 0
                family.add_metric([replica], now + earlier.get(replica, {}).get(field, 0))
        yield from gauges.values()
        yield from counters.values()


class HotHistogram:
    """A Prometheus histogram for a per-token hot path, observed from one thread (the engine's):
    an observation is a bisect and two adds, no lock (prometheus_client's `Histogram.observe`
    takes two locks and scans the buckets). Exposed as a collector: read at scrape time from one
    copy of the counts (a single C-level list copy, atomic under the GIL)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name, self._doc, self._bounds = name, documentation, tuple(buckets)
        self._bound_array = np.array(self._bounds)
        self._counts = [0] * (len(self._bounds) + 1) + [0.0]  # per bucket (le), +Inf, then the sum

    def observe(self, value: float) -> None:
        counts = self._counts
        counts[bisect.bisect_left(self._bounds, value)] += 1
        counts[-1] += value

    def observe_many(self, values: list[float]) -> None:
        counts, bounds, where = self._counts, self._bounds, bisect.bisect_left
        for value in values:
            counts[where(bounds, value)] += 1
        counts[-1] += sum(values)

    def observe_n(self, value: float, n: int) -> None:
        """`n` observations of one value."""
        counts = self._counts
        counts[bisect.bisect_left(self._bounds, value)] += n
        counts[-1] += value * n

    def observe_array(self, values: np.ndarray) -> None:
        counts = self._counts
        per_bucket = np.bincount(np.searchsorted(self._bound_array, values, side="left"), minlength=len(counts) - 1)
        for i in np.flatnonzero(per_bucket).tolist():
            counts[i] += int(per_bucket[i])
        counts[-1] += float(values.sum())

    def describe(self):
        return [HistogramMetricFamily(self._name, self._doc)]

    def collect(self):
        counts = list(self._counts)
        total, cumulative, buckets = counts.pop(), 0, []
        for bound, n in zip((*self._bounds, float("inf")), counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        return [HistogramMetricFamily(self._name, self._doc, buckets=buckets, sum_value=total)]
