"""Prometheus metrics of the gateway itself, served at `GET /metrics` on the HTTP port (and
on `--metrics-port`), named `stepahead:gateway_*`.

Labelled by transport (`grpc` or `http`) so the two front doors can be compared.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.output import Output
from stepahead.plan import FinishReason

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)


class GatewayMetrics:
    def __init__(self) -> None:
        r = CollectorRegistry()
        self.registry = r
        p = "stepahead:gateway_"
        self.started = Counter(p + "requests_started", "requests accepted", ["transport"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "requests refused", ["transport", "status"], registry=r)
        self.finished = Counter(p + "sequences_finished", "sequences ended", ["transport", "reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens submitted", ["transport"], registry=r)
        self.output_tokens = Counter(p + "generation_tokens", "output tokens streamed", ["transport"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "accepted to first token", ["transport"],
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.usage_mismatch = Counter(
            p + "usage_mismatch", "streams whose final usage differs from the token ids they delivered (a bug)",
            ["transport"], registry=r)
        for transport in ("grpc", "http"):
            self.usage_mismatch.labels(transport)  # exported at 0 from the start: something to alert on
        self.undecodable = Counter(
            p + "grpc_undecodable_messages", "gRPC request messages that did not decode (INVALID_ARGUMENT)",
            ["method"], registry=r)
        self.resubmitted = Counter(p + "requests_resubmitted", "requests resubmitted after their scheduler "
                                   "stream broke, by the scheduler that took them", ["scheduler"], registry=r)
        self.active = Gauge(p + "active_requests", "requests open now (both transports)", registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "accepted to finished", ["transport"],
                             registry=r, buckets=_LATENCY_BUCKETS)

    def observe_started(self, transport: str, num_prompt_tokens: int) -> None:
        self.started.labels(transport).inc()
        self.prompt_tokens.labels(transport).inc(num_prompt_tokens)

    def observe_rejected(self, transport: str, status: int | str) -> None:
        self.rejected.labels(transport, str(status)).inc()

    def observe_first_token(self, transport: str, seconds: float) -> None:
        self.ttft.labels(transport).observe(seconds)

    def observe_finished(self, transport: str, out: Output, seconds: float) -> None:
        self.finished.labels(transport, out.finish_reason.value).inc()
        self.output_tokens.labels(transport).inc(out.num_output_tokens)
        self.e2e.labels(transport).observe(seconds)

    def observe_aborted(self, transport: str, num_sequences: int) -> None:
        """Sequences a call ended before they finished (the client went away, or the call
        failed): counted as finished with reason `abort`, as vLLM counts them."""
        self.finished.labels(transport, FinishReason.ABORT.value).inc(num_sequences)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
