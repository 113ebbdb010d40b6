"""A decode worker's KV loads: the blocks of prompts prefilled elsewhere, read and written here.

A plan's `kv_loads` (stepahead/plan.py, "Disaggregated prefill/decode") reach `KVLoader.start`
from the runner, after the plan's swaps, before its forward. Each load runs on a small thread
pool, beside the steps: it calls the source worker's `KVTransfer.ReadBlocks` (over a channel
cached per source address, with the credentials the worker presents to its scheduler),
checks every chunk against this worker's layout, writes the blocks into the load's
destination ids, and reports `KVLoaded(transfer_id, error)` once, as soon as it ends, through
`report` (the attach stream's outbox). A sim runner's load also waits the link's transfer
time (`runner.kv_link_seconds`). One loader lives for one attach session: `close()` cancels
the calls in flight, drops their reports (the scheduler forgot those transfers), joins the
threads and closes the channels.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc

from stepahead.plan import KVLoad, KVLoaded
from worker_service.kv_transfer import max_message_bytes

LOAD_THREADS = 4  # loads that run at once; more wait in the pool's queue
MAX_ERROR_CHARS = 1000  # a KVLoaded error's length at most
# Test-only: seconds each load waits before it reads, so a service test can act while loads
# are in flight (kill their source); read once at import. Never set it in production.
TEST_HOLD_ENV = "STEPAHEAD_TEST_KV_LOAD_HOLD_S"
_TEST_HOLD_S = float(os.environ.get(TEST_HOLD_ENV) or 0.0)


class LoadError(Exception):
    """A load that failed for a reason it names (a reply that does not fit, the deadline)."""


class KVLoader:
    """The KV loads of one attach session (see the module doc).

    `open_channel(address)` makes a channel to a source (`SchedulerClientConfig.scheduler_channel`
    on the daemon: cluster token and TLS); `timeout_s` bounds each load from its start."""

    def __init__(self, runner, open_channel: Callable[..., grpc.Channel], timeout_s: float,
                 report: Callable[[KVLoaded], None], log, on_end: Callable[[bool], None] = lambda ok: None) -> None:
        self.runner, self.log = runner, log
        self._open_channel, self._timeout_s, self._report, self._on_end = open_channel, timeout_s, report, on_end
        self._pool = futures.ThreadPoolExecutor(max_workers=LOAD_THREADS, thread_name_prefix="kv-load")
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._calls: set = set()
        self._closed = threading.Event()

    def start(self, loads: tuple[KVLoad, ...]) -> None:
        """Run each load in the background; each is reported once when it ends."""
        for load in loads:
            self._pool.submit(self._run, load)

    def close(self) -> None:
        """End of the session: cancel what is in flight, drop the reports, join, close channels."""
        with self._lock:
            self._closed.set()
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    # -- one load -----------------------------------------------------------------------------

    def _run(self, load: KVLoad) -> None:
        if _TEST_HOLD_S and self._closed.wait(_TEST_HOLD_S):
            return  # the session ended while held
        started = time.monotonic()
        try:
            self._load(load, started)
            error = ""
        except LoadError as exc:
            error = str(exc)
        except grpc.RpcError as exc:
            error = _rpc_reason(load.source, exc, self._timeout_s)
        except Exception as exc:  # e.g. a write the runner refused: reported, and logged with its trace
            self.log.error("kv_load_crashed", transfer_id=load.transfer_id, source=load.source, exc_info=exc)
            error = f"loading from {load.source}: {exc!r}"
        if self._closed.is_set():
            return  # the session ended: the scheduler forgot this transfer
        if error:
            self.log.warning("kv_load_failed", transfer_id=load.transfer_id, source=load.source, error=error[:300])
        else:
            self.log.debug("kv_loaded", transfer_id=load.transfer_id, blocks=len(load.dst_block_ids),
                           seconds=round(time.monotonic() - started, 6))
        self._on_end(not error)
        self._report(KVLoaded(load.transfer_id, error[:MAX_ERROR_CHARS]))

    def _load(self, load: KVLoad, started: float) -> None:
        from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

        stub = scheduler_pb2_grpc.KVTransferStub(self._channel(load.source))
        call = stub.ReadBlocks(scheduler_pb2.ReadBlocksRequest(transfer_id=load.transfer_id,
                                                               block_ids=load.src_block_ids,
                                                               instance=load.source_instance),
                               timeout=self._timeout_s)
        with self._lock:
            if self._closed.is_set():
                call.cancel()
                raise LoadError("the attach session ended")
            self._calls.add(call)
        per_block, wanted, done = self.runner.kv_bytes_per_block, len(load.src_block_ids), 0
        try:
            for chunk in call:
                n = self._check(chunk, per_block, done, wanted, load.source)
                self.runner.write_kv_blocks(list(load.dst_block_ids[done:done + n]), chunk.data)
                done += n
        finally:
            with self._lock:
                self._calls.discard(call)
        if done != wanted:
            raise LoadError(f"{load.source} sent {done} of the {wanted} blocks asked for")
        self._wait_link(wanted * per_block, started)

    def _check(self, chunk, per_block: int, done: int, wanted: int, source: str) -> int:
        """The chunk's block count, once it fits this worker: its layout and the blocks still due."""
        if chunk.bytes_per_block != per_block:
            raise LoadError(f"{source} sent blocks of {chunk.bytes_per_block} bytes; this worker's are {per_block} "
                            "bytes (a different model, dtype or block size)")
        n = chunk.num_blocks
        if n < 1 or done + n > wanted:
            raise LoadError(f"{source} sent a chunk of {n} blocks after {done} of {wanted}")
        expected = n * per_block if self.runner.holds_kv else 0
        if len(chunk.data) != expected:
            raise LoadError(f"{source} sent {len(chunk.data)} bytes of data for {n} blocks ({expected} expected)")
        return n

    def _wait_link(self, nbytes: int, started: float) -> None:
        """A simulated link's transfer time, from the load's start (0 on a real device)."""
        seconds = self.runner.kv_link_seconds(nbytes)
        if seconds <= 0:
            return
        remaining = started + min(seconds, self._timeout_s) - time.monotonic()
        if remaining > 0 and self._closed.wait(remaining):
            raise LoadError("the attach session ended")
        if seconds > self._timeout_s:
            raise LoadError(f"the link takes {seconds:.3f}s for {nbytes} bytes, over --kv-transfer-timeout "
                            f"{self._timeout_s:g}s")

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if self._closed.is_set():
                raise LoadError("the attach session ended")
            channel = self._channels.get(address)
            if channel is None:
                limit = max_message_bytes(self.runner.kv_bytes_per_block)
                channel = self._channels[address] = self._open_channel(
                    address, options=[("grpc.max_receive_message_length", limit)])
            return channel


def _rpc_reason(source: str, exc: grpc.RpcError, timeout_s: float) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"reading from {source}: no answer within --kv-transfer-timeout {timeout_s:g}s"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"reading from {source}: unreachable ({exc.details()})"
    name = code.name if code is not None else "error"
    return f"reading from {source}: {name}: {exc.details() if hasattr(exc, 'details') else exc}"
