"""`stepahead generate` exits non-zero, saying why, when its stream does not end normally
(a gateway played by the test: a real gRPC server on 127.0.0.1)."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc

ENDINGS = {
    "length": ([generation_pb2.GenerateResponse(text="ab", token_ids=[1, 2], finish_reason=common_pb2.FINISH_REASON_LENGTH)], 0, ""),
    "stop": ([generation_pb2.GenerateResponse(text="ab", finish_reason=common_pb2.FINISH_REASON_STOP)], 0, ""),
    "cut short": ([generation_pb2.GenerateResponse(text="ab", token_ids=[1, 2])], 1, "without a final message"),
    "error": ([generation_pb2.GenerateResponse(text="a"), generation_pb2.GenerateResponse(
        finish_reason=common_pb2.FINISH_REASON_ERROR, error="the worker was lost")], 1, "FINISH_REASON_ERROR: the worker was lost"),
    "abort": ([generation_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_ABORT)], 1, "FINISH_REASON_ABORT"),
    "status": (grpc.StatusCode.RESOURCE_EXHAUSTED, 1, "RESOURCE_EXHAUSTED"),
}


class ScriptedGateway(generation_pb2_grpc.GenerationServicer):
    def __init__(self, ending) -> None:
        self.ending = ending

    def Generate(self, request, context):
        if isinstance(self.ending, grpc.StatusCode):
            context.abort(self.ending, "queue full")
        yield from self.ending


@pytest.mark.parametrize("case", sorted(ENDINGS))
def test_exit_status_follows_how_the_stream_ended(case):
    ending, code, message = ENDINGS[case]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServicer_to_server(ScriptedGateway(ending), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = subprocess.run([sys.executable, "-m", "stepahead.cli", "generate", "--target", f"127.0.0.1:{port}", "hi"],
                              capture_output=True, text=True, timeout=60)
    finally:
        server.stop(0)
    assert done.returncode == code, (done.stdout, done.stderr)
    assert message in done.stderr
