"""The scheduler's Prometheus metrics: the hot-path histogram against prometheus_client's own
(the oracle), and the per-replica series read at scrape time."""

from __future__ import annotations

import collections
import random

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from scheduler_service.metrics import _LATENCY_BUCKETS, HotHistogram, SchedulerMetrics
from scheduler_service.core.events import PlainTokens, RequestEvent
from scheduler_service.core.request import FinishReason
from scheduler_service.core.stats import SchedulerStats


def samples(registry: CollectorRegistry, name: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if s.name.startswith(name)}


def test_hot_histogram_exposes_what_prometheus_histogram_would():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hot = HotHistogram("x_seconds", "doc", _LATENCY_BUCKETS)
    ours.register(hot)
    reference = Histogram("x_seconds", "doc", registry=theirs, buckets=_LATENCY_BUCKETS)
    rng = random.Random(3)
    values = [rng.choice([0.0, *_LATENCY_BUCKETS, 99.0]) for _ in range(50)]  # bounds themselves too
    values += [rng.expovariate(10) for _ in range(500)]
    for v in values:
        reference.observe(v)
    for v in values[:200]:
        hot.observe(v)
    hot.observe_many(values[200:400])
    hot.observe_array(np.array(values[400:]))  # the plain tokens' bulk path
    got, want = samples(ours, "x_seconds"), samples(theirs, "x_seconds")
    want = {k: v for k, v in want.items() if not k[0].endswith("_created")}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


def _stats(**kw) -> SchedulerStats:
    base = dict.fromkeys(SchedulerStats.__dataclass_fields__, 0)
    base["kv_usage"] = 0.0
    base.update(kw)
    return SchedulerStats(**base)


def test_replica_series_are_read_at_scrape_time_and_counters_never_go_back():
    metrics = SchedulerMetrics(CollectorRegistry())
    state = {"live": {"w0": _stats(num_running=3, num_steps=10)}, "earlier": {}}
    metrics.watch_replicas(lambda: (state["live"], state["earlier"]))
    got = samples(metrics.registry, "stepahead:")
    assert got[("stepahead:num_requests_running", (("replica", "w0"),))] == 3
    assert got[("stepahead:scheduler_steps_total", (("replica", "w0"),))] == 10
    # w0's core is lost (10 steps carried), a new core under the same name has done 4: 14, and
    # a replica that is gone for good keeps its counter but loses its gauges
    state["live"] = {"w0": _stats(num_running=1, num_steps=4)}
    state["earlier"] = {"w0": collections.Counter(num_steps=10), "w1": collections.Counter(num_steps=7)}
    got = samples(metrics.registry, "stepahead:")
    assert got[("stepahead:scheduler_steps_total", (("replica", "w0"),))] == 14
    assert got[("stepahead:scheduler_steps_total", (("replica", "w1"),))] == 7
    assert ("stepahead:num_requests_running", (("replica", "w1"),)) not in got
    assert got[("stepahead:num_requests_running", (("replica", "w0"),))] == 1


def test_decode_events_feed_ttft_once_then_itl_and_the_end():
    metrics = SchedulerMetrics(CollectorRegistry())
    metrics.on_submit("a")
    metrics.on_events([RequestEvent("a", (1,), None, 3, 0, queue_time=0.01)])
    metrics.on_events([RequestEvent("a", (2,), None, 3, 0)])
    metrics.on_events([RequestEvent("a", (3, 4), None, 3, 0)])
    metrics.on_plain(PlainTokens(["a", "unknown"], [5, 1]))  # the core's plain decodes (one it never saw start)
    assert metrics._last_token.get("unknown") is None, "a request never submitted is not tracked"
    metrics.on_events([RequestEvent("a", (6,), FinishReason.LENGTH, 3, 0)])
    got = samples(metrics.registry, "stepahead:")
    assert got[("stepahead:time_to_first_token_seconds_count", ())] == 1
    assert got[("stepahead:request_queue_time_seconds_count", ())] == 1
    assert got[("stepahead:inter_token_latency_seconds_count", ())] == 4
    assert got[("stepahead:e2e_request_latency_seconds_count", ())] == 1
    assert got[("stepahead:request_finished_total", (("finished_reason", "length"),))] == 1
