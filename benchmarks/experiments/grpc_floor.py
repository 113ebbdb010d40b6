"""grpc.aio's own cost per streamed message: a `Generation` server with no gateway code.

    PYTHONPATH=. .venv/bin/python benchmarks/experiments/grpc_floor.py --port 50069 --step-ms 22

`Generate` streams `sampling.max_tokens` copies of one prebuilt one-token `GenerateResponse`,
one per step (every stream wakes on one shared future per `--step-ms`), the way the gateway
streams at stream interval 1. What `gateway_stream_cpu.py --floor` measures with it is the
part of the gateway's CPU per token that grpc.aio and asyncio take whatever the gateway does.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from benchmarks.experiments.step_ticker import StepTicker
from stepahead.v1 import generation_pb2, generation_pb2_grpc


class Floor(generation_pb2_grpc.GenerationServicer):
    def __init__(self, step_s: float) -> None:
        self.steps = StepTicker(step_s)

    async def Generate(self, request, context):
        message = generation_pb2.GenerateResponse(request_id="gen-" + "0" * 32, text=" word", token_ids=[1234])
        for _ in range(request.sampling.max_tokens):
            await asyncio.shield(self.steps.next_step())
            yield message

    async def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(name="floor", vocab_size=1000, max_model_len=4096)


async def serve(port: int, step_s: float) -> None:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(Floor(step_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=50069)
    parser.add_argument("--step-ms", type=float, default=22.0)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.step_ms / 1e3))


if __name__ == "__main__":
    main()
