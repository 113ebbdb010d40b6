"""uvicorn's own cost per streamed SSE message: an OpenAI-shaped streaming endpoint with no gateway code.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/http_floor.py --port 50070 --step-ms 22

A bare ASGI app on uvicorn (httptools, as the gateway's HTTP server runs; `--http h11` for
uvicorn's pure-Python protocol, which the gateway used before) answers `POST
/v1/completions` with `max_tokens` copies of one prebuilt completion chunk (`data: {...}`, the
shape of the gateway's), one per step (every stream wakes on one shared future per
`--step-ms`), then a usage chunk and `data: [DONE]`. What `gateway_stream_cpu.py --transport
http --floor` measures with it is the part of the gateway's CPU per token that uvicorn, httptools and
asyncio take whatever the gateway does (`grpc_floor.py` is the same for gRPC).

`--framework`: the same stream through what the gateway's HTTP server is built on, a FastAPI
route returning the gateway's SSE response (`gateway.sse.EventStream`) over an async generator
of the prebuilt chunks (the `framework floor` rows): what they add per message over bare uvicorn.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI resolves the route's annotations here

from benchmarks.experiments.step_ticker import StepTicker
from gateway.sse import EventStream

CHUNK = ("data: " + json.dumps({"id": "cmpl-" + "0" * 32, "object": "text_completion", "created": 1765000000,
                                "model": "llama3-8b-sim", "choices": [{"index": 0, "text": " word", "logprobs": None,
                                                                       "finish_reason": None}]},
                               separators=(",", ":")) + "\r\n\r\n").encode()
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-store")]


class Floor:
    def __init__(self, step_s: float) -> None:
        self.steps = StepTicker(step_s)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        if scope["path"] != "/v1/completions":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"object":"list","data":[{"id":"floor"}]}'})
            return
        n = json.loads(body)["max_tokens"]
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        for _ in range(n):
            await asyncio.shield(self.steps.next_step())
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        usage = {"id": "cmpl-" + "0" * 32, "object": "text_completion", "choices": [],
                 "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\r\n\r\ndata: [DONE]\r\n\r\n".encode()})


def framework_app(floor: Floor):
    """The stream as a FastAPI route with the gateway's SSE response."""
    app = FastAPI()
    payload = CHUNK[len(b"data: "):-4]  # EventStream frames it

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "floor"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        n = (await request.json())["max_tokens"]

        async def chunks():
            for _ in range(n):
                await asyncio.shield(floor.steps.next_step())
                yield payload
            yield json.dumps({"id": "cmpl-" + "0" * 32, "object": "text_completion", "choices": [],
                              "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}}).encode()
            yield b"[DONE]"

        return EventStream(chunks())

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=50070)
    parser.add_argument("--step-ms", type=float, default=22.0)
    parser.add_argument("--framework", action="store_true", help="through FastAPI and the gateway's SSE response")
    parser.add_argument("--http", choices=["h11", "httptools"], default="httptools",
                        help="uvicorn's HTTP implementation (the gateway's: httptools)")
    args = parser.parse_args()
    floor = Floor(args.step_ms / 1e3)
    uvicorn.run(framework_app(floor) if args.framework else floor, host="127.0.0.1", port=args.port, http=args.http,
                lifespan="off", log_level="warning", access_log=False, backlog=2048)


if __name__ == "__main__":
    main()
