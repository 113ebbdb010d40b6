"""Prometheus metrics of the gateway (`--metrics-port`), named like vLLM's `vllm:*` where the
concept is the same. Thread-safe (prometheus_client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.requests = Counter("stepahead:gateway_requests", "Generate calls by final gRPC status code",
                                ["code"], registry=r)
        self.finished = Counter("stepahead:request_success", "finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("stepahead:prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("stepahead:generation_tokens", "output tokens streamed to clients",
                                         registry=r)
        self.rejected = Counter("stepahead:gateway_rejected", "calls refused before reaching a scheduler",
                                ["reason"], registry=r)
        self.active = Gauge("stepahead:gateway_active_streams", "Generate streams open now", registry=r)
