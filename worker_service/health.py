"""The worker's readiness as gRPC health (`grpc.health.v1`, on `--health-port`).

The worker is a gRPC client of its scheduler; this small server is the one port it serves,
for probes (Kubernetes `grpc` probes, `python -m stepahead.healthcheck`). Overall status
(service ""): NOT_SERVING while the model loads and until a scheduler accepted the worker
as a replica, SERVING while it is attached, NOT_SERVING again while it re-attaches (its
scheduler went away) and from the moment it is told to stop (draining). Like every
daemon's health service it carries no credential (probes have none) and says nothing but
the status.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from stepahead import daemon, ports, security
from stepahead.undecodable import UndecodableGuard


class WorkerHealth:
    def __init__(self, host: str, port: int, log) -> None:
        self._lock = threading.Lock()
        self._stopping = False
        # nothing guards this port (health needs no credential): garbage is refused quietly
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[UndecodableGuard(log)],
                                   options=[ports.EXCLUSIVE_PORT])
        self._health = daemon.Health(self._server, [], reflect=False)  # NOT_SERVING
        self.port = security.add_port(self._server, host, port, None, "--health-port")
        self._server.start()

    def attached(self) -> None:
        with self._lock:
            if not self._stopping:  # a stop that raced the attach wins
                self._health.set(True)

    def detached(self) -> None:
        self._health.set(False)

    def stopping(self) -> None:
        with self._lock:
            self._stopping = True
            self._health.set(False)

    def close(self) -> None:
        self.stopping()
        self._server.stop(0.5).wait()


class NoHealth:
    """Without --health-port: the same calls, nothing served."""

    port = None

    def attached(self) -> None:
        pass

    def detached(self) -> None:
        pass

    def stopping(self) -> None:
        pass

    def close(self) -> None:
        pass
