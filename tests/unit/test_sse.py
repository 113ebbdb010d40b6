"""`gateway.sse.EventStream` served by a real uvicorn on 127.0.0.1, read by a raw HTTP client:
the bytes of the events, the end of the body, the keep-alive comment while nothing comes, and
a client that goes away while the stream waits (its iterator is closed at once: that is where
the gateway aborts the request upstream)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.sse import PING, EventStream

TIMEOUT_S = 20.0


async def serve(make_events, ping_s: float = 15.0):
    """(uvicorn server, its serving task, port) for one route streaming `make_events()`."""
    async def route(request):
        return EventStream(make_events(), ping_s)

    app = Starlette(routes=[Route("/s", route, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http="httptools"))  # as the gateway
    task = asyncio.get_running_loop().create_task(server.serve([sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def open_stream(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /s HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"content-type: text/event-stream" in head.lower()
    return reader, writer


def chunks(body: bytes) -> bytes:
    """The payload of a chunked body (the chunked framing removed)."""
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return out


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), TIMEOUT_S * 2))


def test_each_bytes_is_one_data_event_and_the_body_ends():
    async def events():
        for text in ('{"a": 1}', "é ü", "[DONE]"):
            yield text.encode()

    async def test():
        server, task, port = await serve(events)
        try:
            reader, writer = await open_stream(port)
            body = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), TIMEOUT_S)  # the last, empty chunk
            writer.close()
            assert chunks(body) == 'data: {"a": 1}\r\n\r\ndata: é ü\r\n\r\ndata: [DONE]\r\n\r\n'.encode()
        finally:
            server.should_exit = True
            await task

    run(test)


def test_a_quiet_stream_gets_keep_alive_comments_between_events():
    pinged = asyncio.Event()

    async def events():
        await pinged.wait()  # nothing to send until the client has seen a keep-alive comment
        yield b"late"

    async def test():
        server, task, port = await serve(events, ping_s=0.05)
        try:
            reader, writer = await open_stream(port)
            seen = b""
            while PING not in chunks(seen):
                seen += await asyncio.wait_for(reader.read(4096), TIMEOUT_S)
            pinged.set()
            seen += await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), TIMEOUT_S)
            writer.close()
            payload = chunks(seen)
            assert payload.startswith(PING) and payload.endswith(b"data: late\r\n\r\n")
            assert set(payload[:-len(b"data: late\r\n\r\n")].split(PING)) == {b""}  # only comments before it
        finally:
            server.should_exit = True
            await task

    run(test)


def test_a_client_that_leaves_before_the_first_event_closes_the_iterator_at_once():
    waiting, closed = asyncio.Event(), asyncio.Event()

    async def events():
        try:
            waiting.set()
            await asyncio.Event().wait()  # no event ever comes (a long queue, a long prefill)
            yield b"never"
        finally:
            closed.set()  # where the gateway aborts the request upstream

    async def test():
        server, task, port = await serve(events)  # the ping (15 s) never fires here
        try:
            reader, writer = await open_stream(port)
            await asyncio.wait_for(waiting.wait(), TIMEOUT_S)
            writer.close()
            await asyncio.wait_for(closed.wait(), TIMEOUT_S)
        finally:
            server.should_exit = True
            await task

    run(test)
