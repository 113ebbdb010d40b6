"""Prometheus metrics of a worker (`--metrics-port`), named `stepahead:worker_*`.

Fed by the worker's pipeline: one observation per step when its result leaves (step and
forward time from the step's `WorkerTiming`, requests sampled and failed), block copies per
plan when it is launched. Counters live for the daemon's life, across re-attaches.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from stepahead.plan import StepPlan, StepResult

_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
P = "stepahead:worker_"


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.step = Histogram(P + "step_seconds", "plan received to result sent", registry=r, buckets=_STEP_BUCKETS)
        self.forward = Histogram(P + "forward_seconds", "forward launched to sampled ids on the host", registry=r,
                                 buckets=_STEP_BUCKETS)
        self.steps = Counter(P + "steps", "steps executed", registry=r)
        self.sampled = Counter(P + "sampled_tokens", "tokens sampled", registry=r)
        self.failed = Counter(P + "failed_requests", "requests that failed alone on this worker", registry=r)
        self.swapped = Counter(P + "swapped_blocks", "KV blocks copied between device and host",
                               ["direction"], registry=r)
        self.grammar_compile = Histogram(P + "grammar_compile_seconds", "structured outputs: one grammar compiled "
                                         "(cache misses)", registry=r, buckets=_COMPILE_BUCKETS)
        self.grammar_cache_hits = Counter(P + "grammar_cache_hits", "structured outputs: compiled grammar reused",
                                          registry=r)
        self.grammar_cache_misses = Counter(P + "grammar_cache_misses", "structured outputs: grammar compiled "
                                            "(or refused) because the cache did not hold it", registry=r)

        self.kv_loads = Counter(P + "kv_loads", "KV loads from prefill workers that ended (disaggregation), by "
                                "outcome", ["outcome"], registry=r)
        self.kv_transfer_refused = Counter(P + "kv_transfer_refused", "KVTransfer calls refused for a missing or "
                                           "wrong cluster token", ["method"], registry=r)

    def on_kv_load(self, ok: bool) -> None:
        self.kv_loads.labels("ok" if ok else "error").inc()

    def watch_grammars(self, runner) -> None:
        """Observe the runner's grammar compilations (the sim runner has none)."""
        grammar = runner.grammar
        if grammar is not None:
            grammar.cache.observer = self

    def on_grammar_cache_hit(self) -> None:
        self.grammar_cache_hits.inc()

    def on_grammar_cache_miss(self) -> None:
        self.grammar_cache_misses.inc()

    def on_grammar_compiled(self, seconds: float) -> None:
        self.grammar_compile.observe(seconds)

    def on_plan(self, plan: StepPlan) -> None:
        if plan.swap_out:
            self.swapped.labels("out").inc(len(plan.swap_out))
        if plan.swap_in:
            self.swapped.labels("in").inc(len(plan.swap_in))

    def on_result(self, result: StepResult) -> None:
        t = result.timing
        self.steps.inc()
        self.sampled.inc(len(result.sampled_token_ids))
        if result.failed:
            self.failed.inc(len(result.failed))
        if t.result_sent and t.plan_received:
            self.step.observe(max(0.0, t.result_sent - t.plan_received))
        if t.forward_end and t.forward_start:
            self.forward.observe(max(0.0, t.forward_end - t.forward_start))
