"""A Server-Sent Events response for the OpenAI streams, on asyncio alone.

`EventStream` sends each `bytes` of an async generator as one `data:` event, then ends the
body. Around the data it does what an SSE response behind proxies needs: a comment line
(`: ping`) after `ping_s` without an event, so that no proxy's idle timeout closes a stream
that waits for its first token, and a watch on the ASGI `receive` channel, so that a client
that goes away is noticed at once (not only at the next send): the iterator is cancelled,
and its `finally` aborts the request upstream.

Per event it costs one `send` and nothing else: no cancel scope, task or timer per event,
which is what makes it the SSE response here rather than sse-starlette's (that library wraps
every send in an anyio cancel scope for its per-send timeout;
`benchmarks/experiments/gateway_stream_cpu.py --transport http` measures the gateway's CPU
per streamed token). The per-stream work (the watch and the ping timer) is per response.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SEP = b"\r\n"
PING = b": ping" + SEP + SEP
PING_S = 15.0  # a comment after this long without an event (sse-starlette's and many proxies' default)


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], ping_s: float = PING_S) -> None:
        self.events, self.ping_s = events, ping_s
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})  # no proxy buffering
        self._last_send = 0.0  # loop time of the last event or ping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._last_send = loop.time()
        stream = loop.create_task(self._stream(send, loop))
        watch = loop.create_task(_cancel_on_disconnect(receive, stream))
        try:
            while not stream.done():
                await asyncio.wait((stream,), timeout=self.ping_s)
                if not stream.done() and loop.time() - self._last_send >= self.ping_s:
                    self._last_send = loop.time()
                    await send({"type": "http.response.body", "body": PING, "more_body": True})
            if watch.done():  # the client is gone (the watch cancelled the stream): nothing more to send
                return
            stream.result()  # its error, if any, is the response's
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watch.cancel()
            if not stream.done():
                stream.cancel()  # ends the iterator: its cleanup (the upstream abort) runs
                await asyncio.wait((stream,))  # (a cancellation of this call still propagates)

    async def _stream(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        events = self.events
        try:
            async for data in events:
                self._last_send = loop.time()
                await send({"type": "http.response.body", "body": b"data: " + data + SEP + SEP,
                            "more_body": True})
        finally:
            await events.aclose()


async def _cancel_on_disconnect(receive: Receive, stream: asyncio.Task) -> None:
    """Cancel `stream` as soon as the client goes away (its iterator's cleanup runs at once)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.cancel()
