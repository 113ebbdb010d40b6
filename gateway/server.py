"""The gateway daemon: the public `Generation` service, a thin servicer over domain code.

    stepahead gateway --scheduler 127.0.0.1:50051 --port 50050 --model tiny

Per request: proto → `RawGenerateRequest` → `validate()` → the gateway's multiplexed
`Scheduler.Connect` stream (`SchedulerLink`) → `OutputProcessor` (incremental
detokenization, stop strings) → proto deltas. A client that goes away, or a stop string,
sends an abort for the request upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import os
import resource
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from prometheus_client import start_http_server

from gateway.admission import RETRY_AFTER_S, Draining, Overloaded, StreamGate
from gateway.chat_output import ChatOutputParser, ChatParsing, chat_parsing
from gateway.event_stream import LoopEvents, Mailbox, choices
from gateway.generation import ChoiceOutput, Frontend, Rejected
from gateway.grpc_thread import NO_BACKLOG_SHEDDING, AioHealth, GrpcThread, connection_options
from gateway.metrics import GatewayMetrics
from gateway.reasoning_parsers import ReasoningParser
from gateway.scheduler_link import LinkBroken, SchedulerLink
from gateway.tool_choice import ToolFields, ToolMode, ToolRequest, ToolSpec, call_arguments
from gateway.tool_parsers import ToolCallParser
from gateway.scheduler_pool import SchedulerPool
from gateway.validation import RawGenerateRequest, ValidationError
from stepahead.heap import GcPauses, freeze_heap, gc_warning_threshold_field
from stepahead.ports import check_free
from stepahead import codec, daemon, limits, logs, ports, security
from stepahead.plan import FinishReason, SamplingParams
from stepahead.security import AioCredentialInterceptor
from stepahead.security import SchedulerClientConfig
from stepahead import config as cfg
from stepahead import undecodable
from stepahead.undecodable import Undecodable
from model_zoo.builtin_models import DEFAULT_MODEL, MODEL_HELP
from stepahead.logs import RateLimitedLog
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

# How a scheduler's refusal reaches the client.
REJECT_STATUS = {
    scheduler_pb2.REJECT_CODE_INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    scheduler_pb2.REJECT_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    scheduler_pb2.REJECT_CODE_QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# Trailing metadata of RESOURCE_EXHAUSTED / UNAVAILABLE from the gateway itself: when to try
# again (seconds, like HTTP's Retry-After; and gRPC's own retry pushback in milliseconds).
RETRY_HINT = (("retry-after", RETRY_AFTER_S), ("grpc-retry-pushback-ms", str(int(RETRY_AFTER_S) * 1000)))


@dataclass(frozen=True)
class GatewayServingConfig:
    """How the gateway serves its clients: limits, timeouts, streaming (what `stepahead serve`
    hands the gateway it starts)."""

    max_concurrent_streams: int = cfg.field(
        1024, "open requests at most (gRPC and HTTP); more get RESOURCE_EXHAUSTED / 429 at once"
    )
    stream_interval: int = cfg.field(
        1, "stream a sequence's tokens in messages of at least this many (its first token and its end at once); "
           "larger values cost the gateway and clients less CPU per token")
    max_connections: int | None = cfg.field(
        None, "open client connections at most on each public port (gRPC and HTTP); past it a new one is closed at "
              "once. Unset: what the fd limit leaves, split between the two ports")
    http_request_timeout: float = cfg.field(
        10.0, "seconds an HTTP connection gets to send a whole request, from its opening or its previous response")
    http_idle_timeout: float = cfg.field(5.0, "seconds an idle HTTP keep-alive connection stays open")
    grpc_max_connection_idle: float = cfg.field(
        300.0, "seconds a gRPC connection without open calls stays open (it also gets --http-request-timeout to "
               "finish its handshake)")
    drain_timeout: float = cfg.field(30.0, "on SIGTERM, seconds open requests get to finish before the exit")
    tool_call_parser: ToolCallParser | None = cfg.field(
        None, "how the model writes tool calls, for tool_choice auto (vLLM's flag; unset: auto is refused, "
              "required and named functions are enforced by a JSON schema whatever the model)")
    reasoning_parser: ReasoningParser | None = cfg.field(
        None, "split the model's <think> block into reasoning_content (vLLM's flag)")


@dataclass(frozen=True)
class GatewayConfig(GatewayServingConfig, SchedulerClientConfig):
    """`stepahead gateway`'s flags: where it listens and dials, its model, security, and
    `GatewayServingConfig`."""

    scheduler: tuple[str, ...] = cfg.field(
        ("127.0.0.1:50051",), "scheduler address; repeat the flag or give a comma list for several")
    failover_timeout: float = cfg.field(
        60.0, "seconds a request whose scheduler died may take to find another one (then UNAVAILABLE)")
    host: str = cfg.field("127.0.0.1", "address to listen on")
    port: int = cfg.field(50050, "port to listen on")
    http_port: int = cfg.field(8000, "OpenAI-compatible HTTP port (0 disables HTTP)")
    model: str = cfg.field(DEFAULT_MODEL, MODEL_HELP + " (for the tokenizer; already converted)")
    max_request_bytes: int = cfg.field(1 << 20, "largest accepted request message")
    api_key: str | None = cfg.field(None, "API keys clients must send as 'authorization: Bearer KEY' (comma list)")
    ssl_certfile: str | None = cfg.field(None, "TLS certificate (PEM) of the public API (gRPC and HTTP)")
    ssl_keyfile: str | None = cfg.field(None, "TLS private key (PEM) of the public API")
    ssl_ca_certs: str | None = cfg.field(None, "CA bundle: require client certificates signed by it (mTLS)")
    metrics_port: int | None = cfg.field(None, "also serve the gateway's Prometheus /metrics on this port")
    log_level: str = cfg.field("info", "log level")
    gc_warning_threshold_secs: float = gc_warning_threshold_field()


# The proto's spellings of the tool fields, for refusals.
TOOL_FIELDS = ToolFields("chat.tool_choice", "chat.tool_choice.function", "chat.tools")
TOOL_MODES = {
    generation_pb2.TOOL_MODE_UNSPECIFIED: None,
    generation_pb2.TOOL_MODE_NONE: ToolMode.NONE,
    generation_pb2.TOOL_MODE_AUTO: ToolMode.AUTO,
    generation_pb2.TOOL_MODE_REQUIRED: ToolMode.REQUIRED,
}


def chat_messages_from_proto(chat: generation_pb2.Chat) -> list[dict]:
    """The messages as chat templates take them (transformers' convention: a call's
    `arguments` an object)."""
    messages = []
    for i, m in enumerate(chat.messages):
        message: dict = {"role": m.role, "content": m.content}
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name,
                              "arguments": call_arguments(c.arguments, f"chat.messages[{i}].tool_calls[{j}].arguments")}}
                for j, c in enumerate(m.tool_calls)]
        messages.append(message)
    return messages


def tools_from_proto(chat: generation_pb2.Chat) -> tuple[list[dict] | None, ToolRequest]:
    """The tools as chat templates take them (OpenAI's form), and the request's tool choice."""
    limits.check_tool_count(len(chat.tools), TOOL_FIELDS.tools)
    dicts, specs = [], []
    for i, tool in enumerate(chat.tools):
        limits.check_function_name(f"chat.tools[{i}].name", tool.name)
        parameters = None
        if tool.parameters_json:
            parameters = call_arguments(tool.parameters_json, f"chat.tools[{i}].parameters_json")
        function: dict = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if parameters is not None:
            function["parameters"] = parameters
        dicts.append({"type": "function", "function": function})
        specs.append(ToolSpec(tool.name, parameters))
    choice = chat.tool_choice
    which = choice.WhichOneof("choice")
    if which == "mode" and choice.mode not in TOOL_MODES:
        raise ValidationError(TOOL_FIELDS.choice, f"unknown tool mode {choice.mode}")
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    request = ToolRequest(tuple(specs), TOOL_MODES[choice.mode] if which == "mode" else None,
                          choice.function if which == "function" else None, parallel)
    return dicts or None, request


def raw_from_proto(msg: generation_pb2.GenerateRequest, tool_parser: ToolCallParser | None = None,
                   reasoning: ReasoningParser | None = None) -> tuple[RawGenerateRequest, ChatParsing]:
    """The public request's fields, its sampling settings through the codec (the one
    proto -> domain mapping), and how its output is read (a chat's: the gateway's parsers
    and the request's tool choice; a text or token prompt's output is plain). Raises
    ValidationError for a logit_bias map too large to sort, and for malformed tools or
    tool-call arguments."""
    s = msg.sampling
    limits.check_logit_bias_count(len(s.logit_bias))
    which = msg.WhichOneof("prompt")
    sampling = codec.sampling_from_proto(s, default_max_tokens=SamplingParams.max_tokens)
    messages = tools = None
    parsing = ChatParsing()
    if which == "chat":
        messages = chat_messages_from_proto(msg.chat)
        tools, tool_request = tools_from_proto(msg.chat)
        parsing = chat_parsing(tool_request, tool_parser, reasoning, TOOL_FIELDS)
        if parsing.forced is not None:
            sampling = parsing.forced.constrain(sampling, TOOL_FIELDS.choice)
    return RawGenerateRequest(
        request_id=msg.request_id,
        model=msg.model,
        prompt_text=msg.text if which == "text" else None,
        prompt_token_ids=list(msg.token_ids.ids) if which == "token_ids" else None,
        chat_messages=messages,
        chat_tools=tools,
        add_generation_prompt=msg.chat.add_generation_prompt if msg.chat.HasField("add_generation_prompt") else True,
        continue_final_message=msg.chat.continue_final_message,
        chat_template_kwargs=call_arguments(msg.chat.chat_template_kwargs_json, "chat.chat_template_kwargs_json")
        if msg.chat.chat_template_kwargs_json else None,
        sampling=sampling,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        stop=list(msg.stop),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else None,
        priority=msg.priority,
        n=msg.n if msg.HasField("n") else 1,
        size_bytes=msg.ByteSize(),
    ), parsing


def _client_of(context) -> str:
    """What scopes a client's request ids (`generation.scoped_id`): its API key when it sent
    one, else its connection (grpc's peer address)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return f"key:{value}"
    return f"peer:{context.peer()}"


def _logprobs_fields(out) -> dict:
    """GenerateResponse.logprobs / prompt_logprobs of an output (empty when not asked)."""
    fields = {}
    if out.logprobs:
        fields["logprobs"] = [_logprobs_proto(e) for e in out.logprobs]
    if out.prompt_logprobs:
        fields["prompt_logprobs"] = [_logprobs_proto(e) for e in out.prompt_logprobs[1:]]  # position 1 on
    return fields


def _logprobs_proto(e) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(token_id=e.token_id, logprob=e.logprob, top_token_ids=[t.token_id for t in e.top],
                               top_logprobs=[t.logprob for t in e.top])


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Runs on the grpc.aio server's event loop (`grpc_thread.py`)."""

    def __init__(self, frontend: Frontend, log):
        self.frontend = frontend
        self.model = frontend.model
        self.log = log
        self._loop_events: LoopEvents | None = None  # made on the server's event loop

    async def Generate(self, request, context):
        front = self.frontend
        try:  # a text or chat prompt is tokenized off the loop; token ids are cheap to check
            raw, parsing = raw_from_proto(request, front.tool_call_parser, front.reasoning_parser)
            valid = front.validate(raw) if raw.prompt_token_ids is not None else \
                await asyncio.to_thread(front.validate, raw)
        except ValidationError as exc:
            front.metrics.observe_rejected("grpc", grpc.StatusCode.INVALID_ARGUMENT.name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = valid.request_id or f"gen-{uuid.uuid4().hex}"
        if self._loop_events is None:
            self._loop_events = LoopEvents(asyncio.get_running_loop())
        events = Mailbox()
        try:
            gen = front.start(valid, request_id, self._loop_events.sink(events), "grpc", _client_of(context))
        except ValueError as exc:  # the id is already in flight here
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}")
        except Overloaded as exc:  # never a silent queue: the client hears it at once
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing_metadata=RETRY_HINT)
        except Draining as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), trailing_metadata=RETRY_HINT)
        parsers = None if parsing.plain else [ChatOutputParser(parsing) for _ in range(valid.n)]
        try:
            async for choice in choices(gen, events, front.stream_interval):
                parser = None if parsers is None else parsers[choice.index]
                response = self._response(request_id, choice, parser)
                if response is not None:
                    yield response
        except Rejected as exc:
            await context.abort(REJECT_STATUS[exc.code], str(exc))
        except LinkBroken as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            gen.abort()  # client gone (the task is cancelled) or call over: a no-op then

    def _response(self, request_id: str, choice: ChoiceOutput,
                  parser: ChatOutputParser | None) -> generation_pb2.GenerateResponse | None:
        out = choice.output
        parsed = {}
        if parser is not None:
            delta = parser.feed(out.text, out.finished)
            parsed = {"content": delta.content, "reasoning": delta.reasoning}
        if out.finished:
            return self._final(request_id, choice, parsed, parser)
        if not (out.text or out.token_ids or out.logprobs):
            return None
        return generation_pb2.GenerateResponse(request_id=request_id, text=out.text, token_ids=out.token_ids,
                                               index=choice.index, **parsed, **_logprobs_fields(out))

    def _final(self, request_id: str, choice: ChoiceOutput, parsed: dict,
               parser: ChatOutputParser | None) -> generation_pb2.GenerateResponse:
        out = choice.output
        calls = [] if parser is None else [generation_pb2.ToolCall(id=call_id, name=c.name, arguments=c.arguments)
                                           for call_id, c in zip(parser.calls.ids, parser.calls.calls)]
        finish = codec.finish_reason_to_proto(out.finish_reason)
        if calls and out.finish_reason is FinishReason.STOP:  # OpenAI's "tool_calls"
            finish = common_pb2.FINISH_REASON_TOOL_CALLS
        return generation_pb2.GenerateResponse(
            request_id=request_id,
            index=choice.index,
            text=out.text,
            token_ids=out.token_ids,
            **parsed,
            tool_calls=calls,
            **_logprobs_fields(out),
            finish_reason=finish,
            stop_reason=out.stop_reason,
            error=choice.error,
            usage=common_pb2.Usage(
                prompt_tokens=choice.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=choice.num_cached_tokens,
                spec_draft_tokens=choice.spec.draft_tokens,
                spec_accepted_tokens=choice.spec.accepted_tokens,
                spec_acceptance_rate=choice.spec.acceptance_rate,
                spec_mean_accepted_length=choice.spec.mean_accepted_length,
            ),
        )

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(models=[self._info()])

    async def GetModelInfo(self, request, context):
        if request.model and request.model != self.model.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}")
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


MODEL_RETRY_S = 2.0  # the longest wait between asks for the model while no scheduler has a worker
STOP_CHECK_S = 0.05  # while waiting for the model, how often a stop (SIGTERM) is looked at


def wait_for_model(channels, stop, log) -> scheduler_pb2.WorkerHello | None:
    """Ask the schedulers in turn for their model until one has a worker (or we are stopped).
    Between asks it follows their health (SERVING: a worker attached), so it asks again as
    soon as one turns SERVING rather than after a backoff: a model that loads for seconds
    costs no extra second of start-up."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stubs = [scheduler_pb2_grpc.SchedulerStub(ch) for ch in channels]
    serving = threading.Event()
    watches = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), wait_for_ready=True)
               for ch in channels]

    def follow(watch) -> None:
        try:
            for update in watch:
                if update.status == health_pb2.HealthCheckResponse.SERVING:
                    serving.set()
        except grpc.RpcError:  # cancelled once the model is known, or the scheduler went: the asks go on
            return

    followers = [threading.Thread(target=follow, args=(w,), name="model-wait", daemon=True) for w in watches]
    for thread in followers:
        thread.start()
    turn = 0
    try:
        while not stop.is_set():
            stub, turn = stubs[turn % len(stubs)], turn + 1
            try:
                return stub.GetModel(scheduler_pb2.GetModelRequest(), timeout=5, wait_for_ready=len(stubs) == 1)
            except grpc.RpcError as exc:
                if turn <= len(stubs):  # once per scheduler: the wait itself is no news
                    log.info("waiting_for_model", code=exc.code().name)
            deadline = time.monotonic() + MODEL_RETRY_S
            while not (serving.wait(STOP_CHECK_S) or stop.is_set() or time.monotonic() > deadline):
                continue
            serving.clear()
        return None
    finally:
        for watch in watches:
            watch.cancel()
        for thread in followers:
            thread.join(timeout=5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, GatewayConfig)


def worker_attached(channels) -> Callable[[], bool]:
    """/health: some scheduler serves, i.e. has a worker attached (its gRPC health says so;
    GetModel keeps answering while requests wait for a worker to come back)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stubs = [health_pb2_grpc.HealthStub(ch) for ch in channels]

    def ask() -> bool:
        for stub in stubs:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        return False

    return ask


FD_RESERVE = 256  # descriptors kept for the process's own files, scheduler channels and pipes


def raise_fd_limit(log) -> int:
    """Raise the soft fd limit to the hard one (connections are capped below it, so that
    accept() never fails with EMFILE); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited:
        return 1 << 20
    target = (1 << 20) if hard == unlimited else hard
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("fd_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    return soft


def connection_cap(config: GatewayConfig, fd_limit: int) -> int:
    """Open connections allowed on each public port: --max-connections, never more than
    the fd limit leaves for the two ports together."""
    room = max((fd_limit - FD_RESERVE) // 2, 1)
    return room if config.max_connections is None else min(config.max_connections, room)


def run(args: argparse.Namespace) -> int:
    from gateway.tokenizer import GatewayTokenizer
    from model_zoo.builtin_models import resolve_model

    config = cfg.from_args(GatewayConfig, args)
    security.split_keys(config.api_key)  # an empty --api-key fails now, not once the model is there
    if config.stream_interval < 1:
        raise SystemExit(f"--stream-interval must be >= 1, got {config.stream_interval}")
    log = logs.configure("gateway", config.log_level)
    if config.max_connections is not None and config.max_connections < 1:
        raise SystemExit(f"--max-connections must be >= 1, got {config.max_connections}")
    fd_limit = raise_fd_limit(log)
    max_connections = connection_cap(config, fd_limit)
    log.info("connection_limits", fd_limit=fd_limit, max_connections_per_port=max_connections,
             http_request_timeout_s=config.http_request_timeout, http_idle_timeout_s=config.http_idle_timeout,
             grpc_max_connection_idle_s=config.grpc_max_connection_idle)
    metrics = GatewayMetrics()
    try:
        GcPauses(metrics.registry, "stepahead:gateway_gc_pause_seconds", log, config.gc_warning_threshold_secs)
    except ValueError as exc:
        raise SystemExit(f"--gc-warning-threshold-secs: {exc}") from None
    daemon.tune_gil()
    stop = daemon.install_stop_handlers()
    check_free("--port", config.host, config.port)  # said now, not after the scheduler answers
    check_free("--http-port", config.host, config.http_port)
    tokenizer = GatewayTokenizer(resolve_model(config.model, build=False))  # no torch in the gateway
    if not config.scheduler:
        raise SystemExit("--scheduler: give at least one scheduler address")
    channels = [config.scheduler_channel(address) for address in config.scheduler]
    model = wait_for_model(channels, stop, log)  # the limits to validate against come from the worker
    if model is None:
        return 0
    refused = RateLimitedLog(log, "request_refused")  # both transports' refusals past the stream limit
    gate = StreamGate(config.max_concurrent_streams, lambda limit: refused.note(reason="overloaded", limit=limit))
    grpc_server = GrpcThread()  # its event loop runs both public servers and the links to the schedulers
    links = [SchedulerLink(functools.partial(config.scheduler_aio_channel, address), grpc_server.loop, log,
                           config.stream_interval, config.scheduler_metadata()) for address in config.scheduler]
    pool = SchedulerPool(links, config.scheduler, log, config.failover_timeout,
                         on_resubmit=lambda scheduler: metrics.resubmitted.labels(scheduler).inc())
    frontend = Frontend(tokenizer, codec.worker_info_from_proto(model), pool, config.max_request_bytes, metrics, gate,
                        config.stream_interval, config.tool_call_parser, config.reasoning_parser)
    port = grpc_server.start(server_builder(config, frontend, log, max_connections))
    http = _start_http(frontend, channels, config, log, max_connections, grpc_server.loop)
    if config.metrics_port is not None:
        start_http_server(config.metrics_port, addr=config.host, registry=frontend.metrics.registry)
    freeze_heap()  # after the HTTP app is built: FastAPI's routes and models live as long too
    grpc_server.health.set(True)
    log.info("gateway_ready", address=f"{config.host}:{port}", http_port=http.port if http else 0,
             model=model.model_name, pid=os.getpid())
    stop.wait()
    grpc_server.health.set(False)  # probes and balancers stop sending; open requests may finish
    drained = gate.drain(config.drain_timeout)
    log.info("gateway_drained" if drained else "gateway_drain_timeout", open_requests=gate.active)
    pool.close()  # first: the schedulers see this gateway leave now, not after the servers stopped
    if http is not None:
        http.stop()
    grpc_server.stop(2.0)
    return 0


class UndecodableGuard(grpc.aio.ServerInterceptor):
    """Bytes that do not decode as a method's request message are answered INVALID_ARGUMENT
    by the gateway, counted (`on_undecodable(method)`) and logged at most once per interval:
    left to grpc, each one logs an error with a traceback, a log any client can flood.

    The request deserializer is wrapped to hand back an `Undecodable` instead of raising;
    the method's behaviour is wrapped (keeping its kind: coroutine or async generator, a
    request or a request stream) to abort on one before the servicer sees it."""

    def __init__(self, log, on_undecodable: Callable[[str], None] = lambda method: None,
                 interval_s: float = 10.0) -> None:
        self._limited = RateLimitedLog(log, undecodable.EVENT, interval_s)
        self._on_undecodable = on_undecodable

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._guarded(handler, handler_call_details.method)

    async def _refuse(self, method: str, request: Undecodable, context) -> None:
        self._on_undecodable(method)
        self._limited.note(peer=context.peer(), method=method, error=type(request.error).__name__)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, undecodable.DETAILS)

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        streaming_in = handler.request_streaming
        behavior = undecodable.behaviour(handler)
        refuse = self._refuse

        async def checked(requests, context):
            async for request in requests:
                if isinstance(request, Undecodable):
                    await refuse(method, request, context)
                yield request

        if streaming_in:
            if inspect.isasyncgenfunction(behavior):
                async def guarded(requests, context):
                    async for response in behavior(checked(requests, context), context):
                        yield response
            else:
                async def guarded(requests, context):
                    return await behavior(checked(requests, context), context)
        elif inspect.isasyncgenfunction(behavior):
            async def guarded(request, context):
                if isinstance(request, Undecodable):
                    await refuse(method, request, context)
                async for response in behavior(request, context):
                    yield response
        else:
            async def guarded(request, context):
                if isinstance(request, Undecodable):
                    await refuse(method, request, context)
                result = behavior(request, context)  # a servicer method may be sync
                return await result if inspect.isawaitable(result) else result

        return undecodable.rebuilt(handler, guarded)


def server_builder(config: GatewayConfig, frontend: Frontend, log, max_connections: int):
    """How `GrpcThread.start` builds the public gRPC server (grpc.aio): every call is taken at
    once and admitted or refused by the stream gate (RESOURCE_EXHAUSTED past the limit); at
    most `max_connections` connections (grpc core closes the ones past it at once)."""
    keys = security.split_keys(config.api_key)

    async def build(loop):
        interceptors = [UndecodableGuard(log, lambda method: frontend.metrics.undecodable.labels(method).inc())]
        if keys:
            interceptors.append(AioCredentialInterceptor(security.api_key_interceptor(
                keys, security.Refusals(log, lambda method: frontend.metrics.observe_rejected("grpc", 401),
                                        "grpc_call_refused"))))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", 4 * config.max_request_bytes), *NO_BACKLOG_SHEDDING,
                     ports.EXCLUSIVE_PORT,
                     *connection_options(max_connections, config.http_request_timeout,
                                         config.grpc_max_connection_idle)],
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(frontend, log), server)
        health = AioHealth(server, (SERVICE_NAME,), loop)
        tls = security.TLSFiles(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
        return server, health, security.add_port(server, config.host, config.port, tls, "--port")

    return build


def _start_http(frontend: Frontend, channels, config: GatewayConfig, log, max_connections: int,
                loop: asyncio.AbstractEventLoop):
    if config.http_port == 0:
        return None
    from gateway.http_server import HttpServer, OpenAIServer

    server = OpenAIServer(frontend, worker_attached(channels), log, security.split_keys(config.api_key))
    http = HttpServer(server.app, config.host, config.http_port, loop, log=log, max_connections=max_connections,
                      request_timeout_s=config.http_request_timeout, idle_timeout_s=config.http_idle_timeout,
                      ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile, ssl_ca_certs=config.ssl_ca_certs)
    http.start()
    return http
