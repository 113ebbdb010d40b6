"""The KVTransfer service of a prefill worker: decode workers read prefilled blocks from it.

    KVTransferServer(config, log)   binds --kv-transfer-host:--kv-transfer-port at start-up
    server.serve(runner)            answers ReadBlocks from the runner's KV once it is loaded

`ReadBlocks` streams the asked blocks in order, as `KVChunk`s of whole blocks of about
`CHUNK_BYTES` (one block when a block is bigger), each with the worker's `bytes_per_block`
so the reader refuses a layout that is not its own. The internal plane's guards apply as
on the scheduler: the cluster token (UNAUTHENTICATED before the servicer runs), TLS with
--kv-transfer-ssl-certfile/keyfile (mTLS with --kv-transfer-ssl-ca-certs), and undecodable
requests refused quietly. Block ids a peer names are checked against the pool
(`limits.check_kv_blocks`): INVALID_ARGUMENT naming `block_ids`.
"""

from __future__ import annotations

import secrets
import threading
from concurrent import futures

import grpc

from stepahead import config as cfg
from stepahead import limits, ports, security
from stepahead.undecodable import UndecodableGuard

CHUNK_BYTES = 4 * 2**20  # a chunk's payload, rounded down to whole blocks (at least one)
MESSAGE_OVERHEAD = 64 * 2**10  # a chunk's fields beside its data, generously
SERVER_THREADS = 4  # concurrent ReadBlocks calls (each streams from the runner's transfer stream)


def max_message_bytes(bytes_per_block: int) -> int:
    """The largest KVChunk message a reader accepts: `CHUNK_BYTES`, or one block if bigger."""
    return max(CHUNK_BYTES, bytes_per_block) + MESSAGE_OVERHEAD


def blocks_per_chunk(bytes_per_block: int) -> int:
    return max(1, CHUNK_BYTES // max(bytes_per_block, 1))


class KVTransferServicer:
    """`ReadBlocks` over a runner's KV (`read_kv_blocks`, `kv_bytes_per_block`, `num_blocks`);
    UNAVAILABLE until `runner` is set (the model still loads)."""

    def __init__(self, log) -> None:
        self.runner = None
        self.log = log
        self.instance = secrets.token_hex(8)  # this process's service: `WorkerInfo.kv_transfer_instance`

    def ReadBlocks(self, request, context):
        from stepahead.v1 import scheduler_pb2

        runner = self.runner
        if runner is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        if request.instance != self.instance:  # meant for a worker that was here before: its KV is gone
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"instance: this KV transfer service is {self.instance!r}, not {request.instance!r} "
                          "(the worker that held those blocks is gone)")
        try:
            limits.check_kv_blocks("block_ids", request.block_ids, runner.num_blocks)
        except limits.LimitError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        ids = list(request.block_ids)
        per_block = runner.kv_bytes_per_block
        step = blocks_per_chunk(per_block)
        self.log.debug("kv_read", transfer_id=request.transfer_id, blocks=len(ids), peer=context.peer())
        for start in range(0, len(ids), step):
            part = ids[start:start + step]
            yield scheduler_pb2.KVChunk(num_blocks=len(part), bytes_per_block=per_block,
                                        data=runner.read_kv_blocks(part))


class KVTransferServer:
    """The gRPC server of the KVTransfer service, bound at construction (a port it cannot
    bind is a `ConfigError` naming --kv-transfer-port, before the model loads)."""

    def __init__(self, config, log, on_refused=lambda method: None) -> None:
        from stepahead.v1 import scheduler_pb2_grpc

        refusals = security.Refusals(log, on_refused, "kv_transfer_call_refused")
        interceptors = [security.cluster_interceptor(config.cluster_token, refusals)] if config.cluster_token else []
        interceptors.append(UndecodableGuard(log))  # innermost: a refused credential never reads a message
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=SERVER_THREADS,
                                                              thread_name_prefix="kv-transfer"),
                                   interceptors=interceptors,
                                   options=[("grpc.max_send_message_length", -1), ports.EXCLUSIVE_PORT])
        self.servicer = KVTransferServicer(log)
        scheduler_pb2_grpc.add_KVTransferServicer_to_server(self.servicer, self._server)
        try:
            self.port = security.add_port(self._server, config.kv_transfer_host, config.kv_transfer_port,
                                          config.kv_transfer_tls(), "--kv-transfer-port")
        except cfg.ConfigError:  # the port, named (a ConfigError is a ValueError: before the next clause)
            raise
        except (OSError, ValueError) as exc:  # unreadable or incomplete TLS files
            raise cfg.ConfigError(f"--kv-transfer-ssl-*: {exc}") from None
        self.address = ports.host_port(config.kv_transfer_advertise_host or config.kv_transfer_host, self.port)
        self.instance = self.servicer.instance
        self._server.start()
        self._closed = threading.Event()

    def serve(self, runner) -> None:
        """Answer reads from `runner` from now on."""
        self.servicer.runner = runner

    def close(self, grace_s: float = 0.5) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._server.stop(grace_s).wait()
