"""`python -m stepahead.healthcheck HOST:PORT [SERVICE]`: exit 0 when the daemon there
reports SERVING on gRPC health, 1 otherwise (container health checks; no grpcurl needed)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}", file=sys.stderr)
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    return 0 if is_serving(*argv) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
