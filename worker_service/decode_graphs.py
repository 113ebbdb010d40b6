"""Decode steps replayed from captured CUDA graphs (`--no-enforce-eager` on CUDA; vLLM's
`--cuda-graph-sizes` and `--max-cuda-graph-batch-size`).

A decode-only step launches every kernel of the forward from the host, a few dozen per layer;
for a small model at a small batch the device finishes each before the host has launched the
next. A graph captured once for the step's shape replays them all with one launch.

The shape of a decode-only step is (B, W): B rows (the input builder pads the batch to a decode
bucket: 1, 2, 4, 8, then multiples of 8; `input_batch.decode_bucket`) and a block table of W
columns (a power of two). Nothing else of the step reaches a kernel's shape or a host branch of
the forward when its attention backend is graph-safe (`PagedDecodeBackend`: device-side lengths
and tables, shapes from B and W only). One graph per (B, W) therefore serves every step of that
shape, and is captured on the first such step (a capture costs one eager run and one recording,
logged at debug): there are up to `len(sizes) * log2(max blocks)` shapes, too many to capture all
at start-up for a backend whose cost grows with W. A shape whose capture runs out of device memory
runs eagerly from then on, with one warning.

A graph reads its inputs at the addresses it was captured with. The step's inputs live in the
runner's two step arenas (`input_batch.StepBuffers`, one per step parity), so the graphs read a
third arena of the same layout: before each replay, the used prefix of the step's arena (ids,
positions, slots, sequence lengths, block table) goes into it with one device-to-device copy on
the compute stream, after the placeholder ids were filled in. The logits head and the sampler run
eagerly after the replay, on the graph's output (its static hidden states, valid until the next
replay).

`CudaGraph` captures on CUDA. `EagerReplay` stands in where there is no device (CPU tests): it
keeps the captured call and runs it again at each replay over the same tensors, so like a graph
it sees only what was written into the tensors it captured with, and a step whose inputs went
anywhere else replays stale ones (`tests/model/test_decode_graphs.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from worker_service.attention import AttentionMetadata
from worker_service.input_batch import StepBuffers, StepInputs, decode_bucket

log = logging.getLogger(__name__)


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `fn` (run once eagerly first, on the same inputs); returns its output tensor, which
        each replay rewrites (not yet computed: replay once after capturing)."""

    def replay(self) -> None:
        """Run what was recorded, over the tensors it was recorded with."""


class CudaGraph:
    """A `torch.cuda.CUDAGraph` in the graphs' shared memory pool."""

    def __init__(self, pool) -> None:
        self._pool = pool
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # one eager run on a side stream first (lazy initialisation, autotuning, allocator warm-up), after the
        # inputs copied on the current stream; it writes this step's K/V, the same values the replay writes
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        # synchronizes the device first; thread_local: the worker's other threads (the sender waiting on a
        # step's event, a KV transfer) go on while this one records
        with torch.cuda.graph(self._graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()
        return out

    def replay(self) -> None:
        self._graph.replay()


class EagerReplay:
    """Where there is no CUDA graph: capture runs `fn` and keeps it, replay runs it again over the same
    tensors (the address semantics of a graph, without its speed)."""

    def __init__(self, pool=None) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        self._out = fn()
        return self._out

    def replay(self) -> None:
        self._out.copy_(self._fn())  # into the tensor capture returned, as a graph writes its output


@dataclass(frozen=True)
class GraphSettings:
    """Which decode batches replay from graphs (`graph_sizes`), and how graphs are made (`EagerReplay` in
    CPU tests)."""

    sizes: tuple[int, ...]
    graph_type: type = CudaGraph


def graph_sizes(sizes: tuple[int, ...], max_size: int, max_num_seqs: int) -> tuple[int, ...]:
    """The captured batch sizes: `sizes` when given (each a size decode-only steps are padded to), else
    every such size up to `max_size`."""
    buckets = sorted({decode_bucket(n, max_num_seqs) for n in range(1, max_num_seqs + 1)})
    for size in sizes:
        if size not in buckets:
            raise ValueError(f"--cuda-graph-sizes: {size} is no decode batch size (1, 2, 4, 8, then multiples "
                             f"of 8 up to --max-num-seqs {max_num_seqs}, which is one too: the sizes decode-only "
                             f"steps are padded to)")
    return tuple(size for size in (sorted(set(sizes)) or buckets) if size <= max_size)


@dataclass
class _Captured:
    graph: Graph
    hidden: torch.Tensor  # [B, hidden] the graph's output


class DecodeGraphs:
    """Captured decode steps of one runner (see the module docstring).

    `forward(input_ids [B], meta) -> hidden [B, hidden]` is the runner's forward without the head.
    """

    def __init__(self, settings: GraphSettings, forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor],
                 arena: StepBuffers, block_size: int):
        self.sizes = frozenset(settings.sizes)
        self._graph_type = settings.graph_type
        self._forward = forward
        self._block_size = block_size
        # the graphs' own arena: the layout of the runner's step arenas, its own fixed addresses
        self.static = StepBuffers(arena.device, arena.max_tokens, arena.max_reqs, arena.max_blocks_per_req)
        self._pool = torch.cuda.graph_pool_handle() if arena.device.type == "cuda" else None
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._refused: set[tuple[int, int]] = set()  # shapes whose capture ran out of memory: eager
        self.capture_seconds = 0.0
        self.num_replays = 0

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def run(self, inputs: StepInputs, arena: StepBuffers) -> torch.Tensor | None:
        """The hidden states `[B, hidden]` of a decode-only step of a captured size, replayed; None for
        any other step (the caller runs it eagerly)."""
        meta = inputs.meta
        rows = meta.num_decodes
        if rows != inputs.input_ids.shape[0] or rows not in self.sizes or not self._same_layout(arena):
            return None
        width = meta.block_tables.shape[1]
        self._load(arena, arena.tail + rows * width)
        captured = self._graphs.get((rows, width))
        if captured is None:
            if (rows, width) in self._refused:
                return None
            captured = self._capture(rows, width)
            if captured is None:
                return None
        captured.graph.replay()  # after a capture too: a CUDA graph computes nothing while it records
        self.num_replays += 1
        return captured.hidden

    def _load(self, arena: StepBuffers, end: int) -> None:
        """The step's inputs into the graphs' arena: the used prefix `[0, end)` of the step's arena (the
        fixed segments, then the `[B, W]` block table), one copy on the current (compute) stream."""
        self.static.dev[:end].copy_(arena.dev[:end], non_blocking=True)

    def _same_layout(self, arena: StepBuffers) -> bool:
        """False once the runner's arena regrew (a step beyond the configured budget): new offsets."""
        return arena.offsets == self.static.offsets and arena.tail == self.static.tail and (
            len(arena.dev) <= len(self.static.dev))

    def _capture(self, rows: int, width: int) -> _Captured | None:
        """The graph of shape (rows, width), captured; None when the device has no memory left for it (the
        shape then runs eagerly, as before)."""
        start = time.perf_counter()
        s = self.static
        empty = s.dev[:0]
        meta = AttentionMetadata(
            slot_mapping=s.dev_seg("slots", rows), positions=s.dev_seg("positions", rows),
            block_tables=s.dev_tail(0, rows, width), seq_lens=s.dev_seg("seq_lens", rows), num_decodes=rows,
            max_decode_kv=width * self._block_size, decode_uniform=False, max_prefill_kv=0,
            prefill_token_index=empty.view(0, 0), prefill_rows=empty)
        input_ids = s.dev_seg("input_ids", rows)
        graph = self._graph_type(self._pool)
        try:
            hidden = graph.capture(lambda: self._forward(input_ids, meta))  # [rows, hidden]
        except torch.OutOfMemoryError as exc:
            self._refused.add((rows, width))
            log.warning("no CUDA graph for decode steps of %d rows x %d blocks (they run eagerly): out of device "
                        "memory while capturing (%s); a lower --max-cuda-graph-batch-size or "
                        "--gpu-memory-utilization leaves room", rows, width, str(exc).splitlines()[0])
            return None
        captured = self._graphs[(rows, width)] = _Captured(graph, hidden)
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        log.debug("captured the decode graph of %d rows x %d blocks in %.3f s", rows, width, seconds)
        return captured
