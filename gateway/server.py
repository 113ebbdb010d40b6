"""The gateway daemon: the public `Generation` service, a thin servicer over domain code.

    stepahead gateway --scheduler 127.0.0.1:50051 --port 50050 --model tiny

Per request: proto → `RawGenerateRequest` → `validate()` → the gateway's multiplexed
`Scheduler.Connect` stream (`SchedulerLink`) → `OutputProcessor` (incremental
detokenization, stop strings) → proto deltas. A client that goes away, or a stop string,
sends an abort for the request upstream.
"""

from __future__ import annotations

import argparse
import os
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc
from prometheus_client import REGISTRY, start_http_server

from gateway.output import FinishReason, OutputProcessor
from gateway.scheduler_link import LinkBroken, SchedulerLink
from gateway.scheduler_pool import SchedulerPool
from gateway.validation import ModelLimits, RawGenerateRequest, ValidationError, ValidRequest, validate
from gateway.admission import Draining, Overloaded, StreamGate
from gateway.metrics import GatewayMetrics
from stepahead import codec, daemon, logs, security
from stepahead.security import SchedulerClientConfig
from stepahead import config as cfg
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

# How a scheduler's refusal reaches the client.
REJECT_STATUS = {
    scheduler_pb2.REJECT_CODE_INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    scheduler_pb2.REJECT_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    scheduler_pb2.REJECT_CODE_QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True)
class GatewayConfig(SchedulerClientConfig):
    scheduler: tuple[str, ...] = cfg.field(
        ("127.0.0.1:50051",), "scheduler address; repeat the flag or give a comma list for several")
    failover_timeout: float = cfg.field(
        60.0, "seconds a request whose scheduler died may take to find another one (then UNAVAILABLE)")
    host: str = cfg.field("127.0.0.1", "address to listen on")
    port: int = cfg.field(50050, "port to listen on")
    model: str = cfg.field("tiny", "model directory (for the tokenizer) or a built-in model name")
    max_request_bytes: int = cfg.field(1 << 20, "largest accepted request message")
    max_concurrent_streams: int = cfg.field(
        1024, "open Generate streams at most; more get RESOURCE_EXHAUSTED at once (one server thread each)"
    )
    drain_timeout: float = cfg.field(30.0, "on SIGTERM, seconds open streams get to finish before the exit")
    api_key: str | None = cfg.field(None, "API keys clients must send as 'authorization: Bearer KEY' (comma list)")
    ssl_certfile: str | None = cfg.field(None, "TLS certificate (PEM) of the public API")
    ssl_keyfile: str | None = cfg.field(None, "TLS private key (PEM) of the public API")
    ssl_ca_certs: str | None = cfg.field(None, "CA bundle: require client certificates signed by it (mTLS)")
    metrics_port: int | None = cfg.field(None, "serve Prometheus /metrics on this port (off when unset)")
    log_level: str = cfg.field("info", "log level")


def raw_from_proto(msg: generation_pb2.GenerateRequest) -> RawGenerateRequest:
    s = msg.sampling
    which = msg.WhichOneof("prompt")
    return RawGenerateRequest(
        request_id=msg.request_id,
        model=msg.model,
        prompt_text=msg.text if which == "text" else None,
        prompt_token_ids=list(msg.token_ids.ids) if which == "token_ids" else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else None,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        stop=list(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else None,
        priority=msg.priority,
        size_bytes=msg.ByteSize(),
    )


def finish_from_proto(value: int) -> FinishReason | None:
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return FinishReason[common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_")]


def submit_to_proto(valid: ValidRequest, request_id: str) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=valid.prompt_token_ids,
        sampling=codec.sampling_to_proto(valid.sampling),
        priority=valid.priority,
    )


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer, model: scheduler_pb2.WorkerHello, scheduler_channels, config: GatewayConfig, log,
                 metrics: GatewayMetrics | None = None):
        self.tokenizer = tokenizer
        self.model = model
        self.limits = ModelLimits(model.model_name, model.max_model_len, model.vocab_size, config.max_request_bytes)
        self.link = SchedulerPool([SchedulerLink(ch, log) for ch in scheduler_channels], config.scheduler, log,
                                  config.failover_timeout)
        self.log = log
        self.gate = StreamGate(config.max_concurrent_streams)
        self.metrics = metrics or GatewayMetrics()

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def Generate(self, request, context):
        """Admission (overload, drain), then the request; every call ends with a status."""
        try:
            self.gate.enter()
        except (Overloaded, Draining) as exc:
            reason = "overloaded" if isinstance(exc, Overloaded) else "draining"
            self.metrics.rejected.labels(reason).inc()
            self.log.warning("stream_refused", reason=reason, active=self.gate.active)
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if reason == "overloaded" else grpc.StatusCode.UNAVAILABLE
            self.metrics.requests.labels(code.name).inc()
            context.abort(code, str(exc))
        self.metrics.active.inc()
        try:
            yield from self._generate(request, context)
        finally:
            self.gate.leave()
            self.metrics.active.dec()
            self.metrics.requests.labels((context.code() or grpc.StatusCode.OK).name).inc()

    def _generate(self, request, context):
        try:
            valid = validate(raw_from_proto(request), self.limits, self._tokenize)
        except ValidationError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = valid.request_id or f"gen-{uuid.uuid4().hex}"
        try:
            events = self.link.submit(submit_to_proto(valid, request_id))
        except ValueError as exc:  # the id is already in flight here
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}")
        context.add_callback(lambda: self.link.abort(request_id))  # client gone or call over
        processor = OutputProcessor(self.tokenizer, valid)
        try:
            for event in events:
                if event.rejected:
                    context.abort(REJECT_STATUS[event.reject_code], event.message)
                reason = finish_from_proto(event.finish_reason)
                out = processor.on_tokens(event.token_ids, reason)
                if out.finished:
                    self.metrics.generation_tokens.inc(len(out.token_ids))
                    self.metrics.finished.labels(out.finish_reason.name.lower()).inc()
                    if reason is None:
                        self.link.abort(request_id)  # a stop string ended it here
                    yield self._final(request_id, out, event)
                    return
                self.metrics.generation_tokens.inc(len(out.token_ids))
                if out.text or out.token_ids:
                    yield generation_pb2.GenerateResponse(request_id=request_id, text=out.text, token_ids=out.token_ids)
        except LinkBroken as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _final(self, request_id: str, out, event) -> generation_pb2.GenerateResponse:
        return generation_pb2.GenerateResponse(
            request_id=request_id,
            text=out.text,
            token_ids=out.token_ids,
            finish_reason=common_pb2.FinishReason.Value("FINISH_REASON_" + out.finish_reason.name),
            stop_reason=out.stop_reason,
            error=event.message if out.finish_reason is FinishReason.ERROR else "",
            usage=common_pb2.Usage(
                prompt_tokens=event.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=event.num_cached_tokens,
            ),
        )

    def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(models=[self._info()])

    def GetModelInfo(self, request, context):
        if request.model and request.model != self.model.model_name:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
        return self._info()

    def _info(self) -> generation_pb2.ModelInfo:
        m = self.model
        return generation_pb2.ModelInfo(
            name=m.model_name,
            model_type=m.model_type,
            max_model_len=m.max_model_len,
            vocab_size=m.vocab_size,
            eos_token_ids=m.eos_token_ids,
            dtype=m.dtype,
        )


def wait_for_model(channels, stop, log) -> scheduler_pb2.WorkerHello | None:
    """Ask the schedulers in turn for their model until one has a worker (or we are stopped)."""
    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    backoff, turn = 0.05, 0
    while not stop.is_set():
        stub, turn = stubs[turn % len(stubs)], turn + 1
        try:
            return stub.GetModel(scheduler_pb2.GetModelRequest(), timeout=5, wait_for_ready=len(stubs) == 1)
        except grpc.RpcError as exc:
            log.info("waiting_for_model", code=exc.code().name)
        stop.wait(backoff)  # retry backoff, interrupted by SIGTERM
        backoff = min(backoff * 2, 2.0)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, GatewayConfig)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from stepahead.builtin_models import resolve_model

    config = cfg.from_args(GatewayConfig, args)
    log = logs.configure("gateway", config.log_level)
    daemon.tune_gil()
    stop = daemon.install_stop_handlers()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model))
    if not config.scheduler:
        raise SystemExit("--scheduler: give at least one scheduler address")
    channels = [config.scheduler_channel(address) for address in config.scheduler]
    model = wait_for_model(channels, stop, log)  # the limits to validate against come from the worker
    if model is None:
        return 0
    metrics = GatewayMetrics(REGISTRY)
    server, servicer, health, port = build_server(config, tokenizer, model, channels, log, metrics)
    server.start()
    if config.metrics_port is not None:
        start_http_server(config.metrics_port, addr=config.host, registry=REGISTRY)
    health.set(True)
    log.info("gateway_ready", address=f"{config.host}:{port}", model=model.model_name, pid=os.getpid())
    stop.wait()
    health.set(False)  # load balancers stop sending; open streams may finish
    drained = servicer.gate.drain(config.drain_timeout)
    log.info("gateway_drained" if drained else "gateway_drain_timeout", open_streams=servicer.gate.active)
    server.stop(2.0).wait()
    return 0


def build_server(config: GatewayConfig, tokenizer, model, channels, log, metrics: GatewayMetrics):
    """The public gRPC server: one thread per stream up to the limit, and past it
    RESOURCE_EXHAUSTED from grpc itself rather than a silent queue."""
    keys = security.split_keys(config.api_key)
    interceptors = [security.api_key_interceptor(keys, lambda m: metrics.rejected.labels("unauthenticated").inc())
                    ] if keys else []
    threads = config.max_concurrent_streams + 64  # headroom for unary calls and health checks
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads),
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", 4 * config.max_request_bytes)],
        maximum_concurrent_rpcs=threads,
    )
    servicer = GenerationServicer(tokenizer, model, channels, config, log, metrics)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = daemon.Health(server, [SERVICE_NAME])
    tls = security.TLSFiles(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
    port = security.add_port(server, f"{config.host}:{config.port}", tls)
    return server, servicer, health, port
