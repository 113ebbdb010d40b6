"""Request bytes that do not decode as the method's message, answered INVALID_ARGUMENT.

Left to grpc, each undecodable message logs an error with a traceback ("Exception
deserializing message!"), a log any client that reaches the port can flood, the
unauthenticated health service of an internal daemon included. A guard wraps each method's
request deserializer to hand back an `Undecodable` instead of raising, and the method's
behaviour to refuse one before the servicer sees it: counted (`on_undecodable(method)`) and
logged at most once per interval. `UndecodableGuard` is the threaded servers' (worker
health), `AioUndecodableGuard` the scheduler's grpc.aio server's; the gateway's grpc.aio
server has its own over the same two pieces (`gateway.server.UndecodableGuard`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc

from stepahead.logs import RateLimitedLog

EVENT = "grpc_message_undecodable"
DETAILS = "the request message does not decode"


class Undecodable:
    """What a guarded deserializer returns for bytes that are not the method's message."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def lenient(deserializer):
    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything a generated parser raises
            return Undecodable(exc)
    return deserialize


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def behaviour(handler: grpc.RpcMethodHandler):
    return {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
            (True, False): handler.stream_unary, (True, True): handler.stream_stream}[
        (handler.request_streaming, handler.response_streaming)]


def rebuilt(handler: grpc.RpcMethodHandler, guarded) -> grpc.RpcMethodHandler:
    """`handler` with behaviour `guarded` and its deserializer made lenient."""
    make = _HANDLERS[(handler.request_streaming, handler.response_streaming)]
    return make(guarded, request_deserializer=lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer)


class UndecodableGuard(grpc.ServerInterceptor):
    """The guard of a threaded (`grpc.server`) server. Put it last among the interceptors
    (innermost): a credential interceptor before it refuses a call before any message is read."""

    def __init__(self, log, on_undecodable: Callable[[str], None] = lambda method: None,
                 interval_s: float = 10.0) -> None:
        self._limited = RateLimitedLog(log, EVENT, interval_s)
        self._on_undecodable = on_undecodable

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._guarded(handler, handler_call_details.method)

    def _note(self, method: str, request: Undecodable, context) -> None:
        self._on_undecodable(method)
        self._limited.note(peer=context.peer(), method=method, error=type(request.error).__name__)

    def _refuse(self, method: str, request: Undecodable, context) -> None:
        self._note(method, request, context)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, DETAILS)  # raises

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner, refuse = behaviour(handler), self._refuse
        if handler.request_streaming:
            def checked(requests, context):
                # a servicer may read its request stream on a thread of its own, where an abort
                # would be an uncaught exception: the stream ends here instead, and the call
                # ends with this status when the servicer returns
                for request in requests:
                    if isinstance(request, Undecodable):
                        self._note(method, request, context)
                        context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                        context.set_details(DETAILS)
                        return
                    yield request

            def guarded(requests, context):
                return inner(checked(requests, context), context)
        else:
            def guarded(request, context):
                if isinstance(request, Undecodable):
                    refuse(method, request, context)
                return inner(request, context)
        return rebuilt(handler, guarded)


def reads_undecodable(method):
    """Marks a request-streaming aio servicer method that checks each message itself (a hot
    stream: no wrapper per message). It gets an `Undecodable` where a message did not decode
    and must hand it to `AioUndecodableGuard.end_stream` and stop reading."""
    method.reads_undecodable = True
    return method


class AioUndecodableGuard(grpc.aio.ServerInterceptor):
    """The guard of a grpc.aio server (the scheduler's). Put it last among the interceptors
    (innermost). A method's behaviour keeps its kind (coroutine or async generator, a request
    or a request stream). A request stream may be read by a task of the servicer's own,
    where an abort would end only that task: the stream ends there instead, and the call
    ends with INVALID_ARGUMENT when the servicer returns."""

    def __init__(self, log, on_undecodable: Callable[[str], None] = lambda method: None,
                 interval_s: float = 10.0) -> None:
        self._limited = RateLimitedLog(log, EVENT, interval_s)
        self._on_undecodable = on_undecodable

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._guarded(handler, handler_call_details.method)

    def _note(self, method: str, request: Undecodable, context) -> None:
        self._on_undecodable(method)
        self._limited.note(peer=context.peer(), method=method, error=type(request.error).__name__)

    def end_stream(self, method: str, request: Undecodable, context) -> None:
        """A `reads_undecodable` method read `request`: counted, logged, and the call ends
        INVALID_ARGUMENT once the servicer returns (it stops reading)."""
        self._note(method, request, context)
        context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        context.set_details(DETAILS)

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        behavior, note = behaviour(handler), self._note
        if handler.request_streaming and getattr(behavior, "reads_undecodable", False):
            return rebuilt(handler, behavior)

        async def checked(requests, context):
            async for request in requests:
                if isinstance(request, Undecodable):
                    note(method, request, context)
                    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                    context.set_details(DETAILS)
                    return
                yield request

        if handler.request_streaming:
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
                    note(method, request, context)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, DETAILS)
                async for response in behavior(request, context):
                    yield response
        else:
            async def guarded(request, context):
                if isinstance(request, Undecodable):
                    note(method, request, context)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, DETAILS)
                result = behavior(request, context)  # a servicer method may be sync
                return await result if inspect.isawaitable(result) else result
        return rebuilt(handler, guarded)
