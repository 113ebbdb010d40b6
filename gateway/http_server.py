"""The gateway's OpenAI-compatible HTTP server (FastAPI + uvicorn, SSE via `gateway.sse`).

A thin transport over `gateway.generation.Frontend`, exactly like the gRPC servicer:
body → pydantic model → `RawGenerateRequest` → `Frontend.validate` → `Frontend.start`
→ `ChoiceOutput`s → OpenAI JSON / SSE chunks. Scheduler events reach the event loop
through `event_stream.LoopEvents` and are read with `event_stream.choices`; a client that disconnects (streaming or not) aborts every
one of its `n` sequences upstream.

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
value or a body that does not match the schema (param names the field, as OpenAI and
vLLM answer), 404 for an unknown model or path, 413 for an oversized body, 503 when no
worker is attached or the scheduler link is down. A failure after a stream has started is sent as one
`{"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from importlib import metadata

import orjson
import pydantic
import uvicorn
from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.admission import RETRY_AFTER_S, Draining, Overloaded
from gateway.event_stream import LoopEvents, Mailbox, batch_choices
from gateway.generation import Frontend, Generation, Rejected
from gateway.openai_format import ChatFormat, CompletionFormat, error_body
from gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_parsing,
    chat_to_raw,
    completion_prompts,
    completion_to_raw,
    echo_only,
    message_dict,
    openai_param,
    tool_dicts,
)
from gateway.openai_responses import ResponsesFormat, ResponsesRequest, chat_request
from gateway.scheduler_link import LinkBroken
from gateway.sse import EventStream
from gateway.tokenizer import HEAP_TRIM
from gateway.validation import RawGenerateRequest, ValidationError, ValidRequest, chat_options
from stepahead import security
from stepahead.logs import RateLimitedLog
from stepahead.v1 import scheduler_pb2




class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type_, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER_S} if self.status in (429, 503) else None
        return JSONResponse(error_body(str(self), self.type, self.param, self.code or self.status), self.status,
                            headers=headers)


def _validation_api_error(exc: ValidationError, chat: bool) -> ApiError:
    if exc.field == "model":
        return ApiError(404, str(exc), "model", "not_found_error", "model_not_found")
    param = openai_param(exc.field, chat=chat)
    return ApiError(400, f"{param}: {exc.reason}" if param else exc.reason, param)


def _schema_api_error(exc: pydantic.ValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}")
    path, tag = _field_path(first["loc"])
    param = ".".join(str(part) for part in path)
    if tag is None:
        return ApiError(400, f"{param or 'body'}: {first['msg']}", param or None)
    # a union (`prompt`: a text, token ids, or a batch of either) none of whose forms matched:
    # name the field and its forms, not pydantic's path into the first form it tried
    forms = list(dict.fromkeys(t for t in (_field_path(e["loc"]) for e in errors) if t[0] == path and t[1]))
    return ApiError(400, f"{param}: must be one of {', '.join(t for _, t in forms)}", param)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc: tuple) -> tuple[tuple, str | None]:
    """An error location's fields and indexes up to the first union form pydantic names in it
    (`("prompt", "list[int]", 0)` → `(("prompt",), "list[int]")`), and that form (or None).
    A form is a part that no field of the API is named like: a type (`str`, `list[int]`) or a
    model's class (`TextPart`)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (part in _TYPE_NAMES or not part.isidentifier() or not part.islower()):
            return tuple(loc[:i]), part
    return tuple(loc), None


def _upstream_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), type_="rate_limit_error")
    if isinstance(exc, Draining):
        return ApiError(503, str(exc), type_="service_unavailable")
    code = exc.code if isinstance(exc, Rejected) else None
    if code == scheduler_pb2.REJECT_CODE_INVALID:
        return ApiError(400, str(exc))
    if code == scheduler_pb2.REJECT_CODE_QUEUE_FULL:
        return ApiError(429, str(exc), type_="rate_limit_error")
    return ApiError(503, str(exc), type_="service_unavailable")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    """The FastAPI app; `worker_attached()` answers /health (it may block: run in a thread)."""

    def __init__(self, frontend: Frontend, worker_attached: Callable[[], bool], log,
                 api_keys: tuple[str, ...] = ()) -> None:
        self.frontend = frontend
        self.worker_attached = worker_attached
        self.log = log
        self._loop_events: LoopEvents | None = None  # made on the server's event loop
        self.app = FastAPI(title="stepahead", version=_version(), redoc_url=None)  # /openapi.json and /docs
        self._routes()
        self.app.openapi = self._openapi
        if api_keys:
            self.app.add_middleware(ApiKeyCheck, keys=api_keys,
                                    on_reject=lambda: frontend.metrics.observe_rejected("http", 401))

    def _routes(self) -> None:
        app = self.app
        app.add_exception_handler(ApiError, lambda _req, exc: exc.response())
        app.add_exception_handler(StarletteHTTPException, _http_exception)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/responses")(self.responses)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model:path}")(self.model)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.get("/version")(self.version)

    async def completions(self, request: Request):
        body, size = await self._parse(request, CompletionRequest)

        def prepare():
            prompts = completion_prompts(body)
            return [_in_batch(self.frontend, completion_to_raw(body, size, prompt), i, len(prompts))
                    for i, prompt in enumerate(prompts)]

        valids = await self._validate(prepare, chat=False)
        echo = [self._echo_text(prompt, valid) for prompt, valid in zip(completion_prompts(body), valids)] \
            if body.echo else [None] * len(valids)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.frontend.model.model_name, valids[0].n, echo,
                               logprobs=valids[0].sampling.logprobs is not None, echo_only=echo_only(body))
        return await self._respond(request, valids, fmt, body)

    async def chat_completions(self, request: Request):
        body, size = await self._parse(request, ChatCompletionRequest)

        def prepare():
            parsing = chat_parsing(body, self.frontend.tool_call_parser, self.frontend.reasoning_parser)
            return self.frontend.validate(chat_to_raw(body, size)), parsing

        valid, parsing = await self._validate(prepare, chat=True)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.frontend.model.model_name, valid.n,
                         logprobs=valid.sampling.logprobs is not None, parsing=parsing)
        return await self._respond(request, [valid], fmt, body)

    async def responses(self, request: Request):
        """OpenAI's Responses API, on the chat path (`openai_responses`)."""
        body, size = await self._parse(request, ResponsesRequest)

        def prepare():
            chat = chat_request(body)
            parsing = chat_parsing(chat, self.frontend.tool_call_parser, self.frontend.reasoning_parser)
            return self.frontend.validate(chat_to_raw(chat, size)), parsing

        valid, parsing = await self._validate(prepare, chat=True)
        fmt = ResponsesFormat(f"resp_{uuid.uuid4().hex}", self.frontend.model.model_name, parsing,
                              body.max_output_tokens)
        return await self._respond(request, [valid], fmt, body)

    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str):
        """One model's card (the `openai` client's `models.retrieve`); a name this server does
        not serve is a 404."""
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        m = self.frontend.model
        root = getattr(self.frontend.tokenizer, "model_dir", None)  # the directory a client loads a tokenizer from
        return {"id": m.model_name, "object": "model", "created": int(time.time()), "owned_by": "stepahead",
                "root": str(root) if root is not None else m.model_name, "parent": None,
                "max_model_len": m.max_model_len}

    async def tokenize(self, request: Request):
        """vLLM's `/tokenize`: `prompt` (special tokens added unless `add_special_tokens` is
        false) or `messages` (the chat template's ids, as a chat completion's prompt)."""
        raw = await self._read(request)
        try:
            chat = isinstance(parsed := json.loads(raw), dict) and "messages" in parsed
        except ValueError:
            chat = False  # model_validate_json names the JSON error
        body, _ = self._validated(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        self._check_model(body.model)
        tokenizer = self.frontend.tokenizer

        def ids() -> list[int]:
            if not chat:
                return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            options = chat_options(body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)
            rendered = self.frontend.render_chat([message_dict(m, i) for i, m in enumerate(body.messages)],
                                                 body.add_generation_prompt, tool_dicts(body.tools), **options)
            if not body.add_special_tokens:
                return rendered
            return tokenizer.encode(tokenizer.decode(rendered), add_special_tokens=True)

        tokens = await self._validate(ids, chat=chat)
        return {"count": len(tokens), "max_model_len": self.frontend.model.max_model_len, "tokens": tokens}

    async def detokenize(self, request: Request):
        """vLLM's `/detokenize`: `tokens` back to text (special tokens kept, as vLLM does)."""
        body, _ = self._validated(await self._read(request), DetokenizeRequest)
        self._check_model(body.model)
        vocab = self.frontend.limits.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: {bad} is not a token id (the vocabulary has {vocab})", "tokens")
        text = await to_thread.run_sync(lambda: self.frontend.tokenizer.decode(body.tokens, skip_special_tokens=False))
        return {"prompt": text}

    def _check_model(self, model: str | None) -> None:
        name = self.frontend.model.model_name
        if model and model != name:
            raise ApiError(404, f"unknown model {model!r}; this server serves {name!r}", "model", "not_found_error",
                           "model_not_found")

    def _openapi(self) -> dict:
        """FastAPI's schema, with the request bodies the handlers parse themselves (they read
        the raw body to bound its size, so FastAPI cannot see their models)."""
        if self.app.openapi_schema:
            return self.app.openapi_schema
        schema = get_openapi(title=self.app.title, version=self.app.version, routes=self.app.routes,
                             description="OpenAI-compatible API (see docs/http-api.md)")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        bodies = {"/v1/completions": [CompletionRequest], "/v1/chat/completions": [ChatCompletionRequest],
                  "/v1/responses": [ResponsesRequest],
                  "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest], "/detokenize": [DetokenizeRequest]}
        for path, models in bodies.items():
            refs = []
            for model in models:
                body_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body_schema.pop("$defs", {}))
                components[model.__name__] = body_schema
                refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
            shown = refs[0] if len(refs) == 1 else {"anyOf": refs}
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": shown}}}
        self.app.openapi_schema = schema
        return schema

    async def health(self):
        attached = await to_thread.run_sync(self.worker_attached)
        return Response(status_code=200 if attached else 503)

    async def metrics(self):
        return Response(self.frontend.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def version(self):
        return {"version": _version()}

    async def _parse(self, request: Request, model: type[pydantic.BaseModel]):
        return self._validated(await self._read(request), model)

    async def _read(self, request: Request) -> bytes:
        try:
            return await read_body(request, self.frontend.limits.max_request_bytes)
        except ApiError:
            HEAP_TRIM.soon()
            raise

    def _validated(self, raw: bytes, model: type[pydantic.BaseModel]):
        try:
            body = model.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            error = _schema_api_error(exc)
            self.frontend.metrics.observe_rejected("http", error.status)
            HEAP_TRIM.soon()
            raise error from None
        return body, len(raw)

    async def _validate(self, prepare, *, chat: bool):
        try:
            return await to_thread.run_sync(prepare)  # tokenizing / templating can take a while
        except ValidationError as exc:
            error = _validation_api_error(exc, chat)
            self.frontend.metrics.observe_rejected("http", error.status)
            HEAP_TRIM.soon()
            raise error from None

    def _echo_text(self, prompt: str | list[int], valid) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.frontend.tokenizer.decode(list(valid.prompt_token_ids), skip_special_tokens=False)

    async def _respond(self, request: Request, valids: list, fmt, body):
        """Start a generation per prompt (one; a completions batch: several, into one
        mailbox) and answer with their choices, streamed or whole."""
        if self._loop_events is None:
            self._loop_events = LoopEvents(asyncio.get_running_loop())
        events = Mailbox()
        sink = self._loop_events.sink(events)
        gens: list[Generation] = []
        try:
            for i, valid in enumerate(valids):
                gens.append(self.frontend.start(valid, fmt.id if len(valids) == 1 else f"{fmt.id}-{i}", sink, "http"))
        except (Overloaded, Draining) as exc:
            _abort(gens)
            raise _upstream_api_error(exc) from None
        except Exception:
            _abort(gens)
            raise
        if body.stream:
            options = getattr(body, "stream_options", None)
            usage = options is not None and options.include_usage
            return EventStream(self._stream(gens, events, fmt, usage, usage and options.continuous_usage_stats))
        return await self._collect(request, gens, events, fmt)

    async def _stream(self, gens: list[Generation], events: Mailbox, fmt, include_usage: bool,
                      continuous_usage: bool = False):
        """The SSE events (JSON by orjson: several times faster than `json.dumps` per chunk, and
        compact); with `continuous_usage` (vLLM's `stream_options.continuous_usage_stats`,
        which needs `include_usage`) every chunk carries the usage so far."""
        try:
            try:
                async for choice in batch_choices(gens, events, self.frontend.stream_interval):
                    for chunk in fmt.chunk(choice):
                        if continuous_usage:
                            chunk["usage"] = fmt.usage()
                        yield orjson.dumps(chunk)
                if include_usage:
                    yield orjson.dumps(fmt.usage_chunk())
            except (Rejected, LinkBroken) as exc:
                error = _upstream_api_error(exc)
                yield orjson.dumps(error_body(str(error), error.type, error.param, error.status))
            yield b"[DONE]"
        finally:
            _abort(gens)  # the client went away (cancellation) or we are done: a no-op then

    async def _collect(self, request: Request, gens: list[Generation], events: Mailbox, fmt):
        async def accumulate():
            async for choice in batch_choices(gens, events, self.frontend.stream_interval):
                fmt.accumulate(choice)

        work = asyncio.ensure_future(accumulate())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            _abort(gens)  # gives the stream slots back; a no-op upstream when they finished
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        try:
            work.result()
        except (Rejected, LinkBroken) as exc:
            raise _upstream_api_error(exc) from None
        return JSONResponse(fmt.full())


def _abort(gens: list[Generation]) -> None:
    for gen in gens:
        gen.abort()


def _in_batch(frontend: Frontend, raw: RawGenerateRequest, index: int, size: int) -> ValidRequest:
    """`frontend.validate(raw)`, its error naming the prompt when it is one of a batch."""
    try:
        return frontend.validate(raw)
    except ValidationError as exc:
        if size == 1:
            raise
        raise ValidationError(exc.field, f"{exc.reason} (prompt {index} of the batch)") from None


OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect"})  # documentation, as vLLM


class ApiKeyCheck:
    """ASGI middleware: every route but health and the API documentation (`OPEN_PATHS`) needs
    `Authorization: Bearer KEY` with one of `keys`; anything else is answered 401 in OpenAI's
    error shape before it reaches a route. A plain ASGI layer, not Starlette's
    `BaseHTTPMiddleware` (`app.middleware("http")`), which pipes every message of a streamed
    response through a memory stream and a task of its own: a hop per SSE event of every stream
    on a server with API keys."""

    def __init__(self, app, keys: tuple[str, ...], on_reject: Callable[[], None]) -> None:
        self.app = app
        self._secrets = tuple(k.encode() for k in keys)
        self._on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._permits(scope["headers"]):
            await self.app(scope, receive, send)
            return
        self._on_reject()
        response = JSONResponse(error_body("missing or wrong API key", "authentication_error", None,
                                           "invalid_api_key"), 401, headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)

    def _permits(self, headers: list[tuple[bytes, bytes]]) -> bool:
        return any(name == b"authorization" and security.holds_secret(value.decode("latin-1"), "Bearer ", self._secrets)
                   for name, value in headers)


async def _http_exception(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), type_, None, exc.status_code), exc.status_code)


def _version() -> str:
    try:
        return metadata.version("stepahead")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class _RateLimitFilter(logging.Filter):
    """uvicorn's and asyncio's per-connection warnings through a `RateLimitedLog`."""

    def __init__(self, limited: RateLimitedLog) -> None:
        super().__init__()
        self._limited = limited

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "accept" in record.getMessage():
            self._limited.note(logger=record.name, message=record.getMessage())
            return False
        return True


def guarded_protocol(max_connections: int, request_timeout_s: float, max_header_bytes: int,
                     log) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (llhttp, in C) with a cap on open connections, a request
    deadline and a limit on a request's head.

    Past `max_connections` a new connection is reset at once (it never holds a file
    descriptor): the cap sits below the fd limit, so accept() never fails and open streams
    go on. A connection must deliver a whole request (head and body) within
    `request_timeout_s` of opening or of its previous response, else it is closed: an
    idle or trickling client (slowloris) cannot hold a slot. A head that passes
    `max_header_bytes` before it ends is answered 400 and its connection closed (llhttp
    itself bounds no header, and uvicorn keeps every one it parses). The protocol used to be
    uvicorn's h11 one: httptools costs several µs less per streamed message
    (`benchmarks/experiments/http_floor.py --http`, docs/benchmarks.md).
    """
    refused = RateLimitedLog(log, "http_connection_refused")
    timed_out = RateLimitedLog(log, "http_request_timeout")

    class GuardedHttpTools(HttpToolsProtocol):
        _refused = False
        _deadline: asyncio.TimerHandle | None = None
        _head_open = True  # no request head has ended since the last request (or the connection) began
        _head_bytes = 0  # bytes received while it was open
        _answering = 0  # requests received whole and not yet answered (a pipelined one waits its turn)

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._refused = True
                transport.abort()
                refused.note(open_connections=len(self.connections), max_connections=max_connections)
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._head_open:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._head_open and self._head_bytes > max_header_bytes and not self.transport.is_closing():
                self.logger.warning("Request head larger than %d bytes.", max_header_bytes)  # rate-limited
                self.send_400_response("Invalid HTTP request received.")

        def on_headers_complete(self) -> None:
            self._head_open = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head_open, self._head_bytes = True, 0  # the next request's head starts
            self._answering += 1
            self._disarm()  # the whole request is in: the app answers in its own time

        def on_response_complete(self) -> None:
            self._answering -= 1
            super().on_response_complete()
            if not self.transport.is_closing() and self._answering <= 0:  # else a pipelined request runs now
                self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and self._answering <= 0:
                timed_out.note(open_connections=len(self.connections), timeout_s=request_timeout_s)
                self.transport.close()

    return GuardedHttpTools


class HttpServer:
    """uvicorn serving `app` on `loop` (the gateway's one event loop, which also runs the public
    gRPC server and the scheduler links: a stream's events reach its SSE response without a
    thread hand-off), on a socket bound up front, with at most `max_connections` open
    connections, each allowed `request_timeout_s` to deliver a request and `idle_timeout_s`
    between requests."""

    def __init__(self, app, host: str, port: int, loop: asyncio.AbstractEventLoop, *, log, max_connections: int,
                 request_timeout_s: float, idle_timeout_s: float, max_header_bytes: int = 16 * 1024,
                 ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 ssl_ca_certs: str | None = None) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(1024)
        self.port = self._sock.getsockname()[1]
        self._loop, self._log = loop, log
        tls = dict(ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, ssl_ca_certs=ssl_ca_certs,
                   ssl_cert_reqs=ssl.CERT_REQUIRED if ssl_ca_certs else ssl.CERT_NONE) if ssl_certfile else {}
        noisy = _RateLimitFilter(RateLimitedLog(log, "http_connection_warning"))
        for name in ("uvicorn.error", "asyncio"):
            logging.getLogger(name).addFilter(noisy)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                http=guarded_protocol(max_connections, request_timeout_s, max_header_bytes, log),
                                timeout_keep_alive=idle_timeout_s, log_config=None, **tls)
        self._server = uvicorn.Server(config)
        self._serving: concurrent.futures.Future | None = None

    def start(self) -> None:
        """Load the app and its TLS context here (a bad certificate raises to the caller), then
        serve on the loop; the socket already listens, so a client may connect at once."""
        self._server.config.load()
        self._serving = asyncio.run_coroutine_threadsafe(self._server.serve([self._sock]), self._loop)
        self._serving.add_done_callback(self._ended)

    def _ended(self, serving: concurrent.futures.Future) -> None:
        if not serving.cancelled() and serving.exception() is not None:
            self._log.error("http_server_failed", error=repr(serving.exception()))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let open responses finish for up to `timeout_s`, then cancel them."""
        self._server.should_exit = True
        if self._serving is not None and not concurrent.futures.wait([self._serving], timeout_s).done:
            self._serving.cancel()
        self._sock.close()
