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

from gateway.output import FinishReason, OutputProcessor
from gateway.scheduler_link import LinkBroken, SchedulerLink
from gateway.scheduler_pool import SchedulerPool
from gateway.validation import ModelLimits, RawGenerateRequest, ValidationError, ValidRequest, validate
from stepahead import codec, daemon, logs
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
class GatewayConfig:
    scheduler: tuple[str, ...] = cfg.field(
        ("127.0.0.1:50051",), "scheduler address; repeat the flag or give a comma list for several")
    failover_timeout: float = cfg.field(
        60.0, "seconds a request whose scheduler died may take to find another one (then UNAVAILABLE)")
    host: str = cfg.field("127.0.0.1", "address to listen on")
    port: int = cfg.field(50050, "port to listen on")
    model: str = cfg.field("tiny", "model directory (for the tokenizer) or a built-in model name")
    max_request_bytes: int = cfg.field(1 << 20, "largest accepted request message")
    max_workers: int = cfg.field(512, "gRPC server threads (one per open stream)")
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
    def __init__(self, tokenizer, model: scheduler_pb2.WorkerHello, scheduler_channels, config: GatewayConfig, log):
        self.tokenizer = tokenizer
        self.model = model
        self.limits = ModelLimits(model.model_name, model.max_model_len, model.vocab_size, config.max_request_bytes)
        self.link = SchedulerPool([SchedulerLink(ch, log) for ch in scheduler_channels], config.scheduler, log,
                                  config.failover_timeout)
        self.log = log

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def Generate(self, request, context):
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
                    if reason is None:
                        self.link.abort(request_id)  # a stop string ended it here
                    yield self._final(request_id, out, event)
                    return
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
    channels = [grpc.insecure_channel(address) for address in config.scheduler]
    model = wait_for_model(channels, stop, log)  # the limits to validate against come from the worker
    if model is None:
        return 0
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers),
        options=[("grpc.max_receive_message_length", 4 * config.max_request_bytes)],
    )
    servicer = GenerationServicer(tokenizer, model, channels, config, log)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = daemon.Health(server, [SERVICE_NAME])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    server.start()
    health.set(True)
    log.info("gateway_ready", address=f"{config.host}:{port}", model=model.model_name, pid=os.getpid())
    daemon.serve_until_stopped(server, stop)
    return 0
