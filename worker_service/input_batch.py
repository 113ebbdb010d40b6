"""Per-request worker state and the step's flattened inputs, built in persistent buffers.

Host side: each request owns a row of a persistent block table (`RequestTable`); a step
writes only its new block ids there, and the step's `[rows, width]` table is one numpy
gather of those rows.

Device side (`StepBuffers`): one int64 arena per buffer slot, pinned on the host and
mirrored on the device, allocated once at a fixed capacity so its addresses never change
(what a captured CUDA graph needs). Every per-step int input is a view at a fixed offset
of it; the whole step goes to the device as ONE contiguous non-blocking copy of the used
prefix (the variable-size block table and prefill index sit at the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from stepahead.plan import SamplingParams
from worker_service.attention import AttentionMetadata, HostMetadata


@dataclass
class CachedRequest:
    """What the worker remembers about a request between steps."""

    request_id: str
    token_ids: list[int]  # every token the worker knows: prompt (+ resumed output) + sampled
    sampling: SamplingParams
    block_ids: list[int]
    num_computed: int
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt
    row: int = -1  # the request's row in the RequestTable

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class ScheduledBatch:
    """A step's requests as parallel lists (no per-request object on the hot path), decodes
    (one-token queries) first."""

    states: list[CachedRequest] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    placeholder: list[bool] = field(default_factory=list)  # input id comes from the previous step's device ids

    def add(self, state: CachedRequest, num_scheduled: int, placeholder: bool) -> None:
        self.states.append(state)
        self.num_scheduled.append(num_scheduled)
        self.placeholder.append(placeholder)

    def __len__(self) -> int:
        return len(self.states)

    def __add__(self, other: ScheduledBatch) -> ScheduledBatch:
        return ScheduledBatch(self.states + other.states, self.num_scheduled + other.num_scheduled,
                              self.placeholder + other.placeholder)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64 on device (padding rows: token 0)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] int64: rows of the hidden states to sample
    sampling_reqs: list[CachedRequest]  # in logits row order
    placeholder_dst: torch.Tensor  # [num_placeholders] token index in input_ids
    placeholder_src: torch.Tensor  # [num_placeholders] row in the previous step's sampled ids
    num_padding: int = 0  # decode rows added to reach a bucket size (dummy KV block)


def decode_bucket(n: int, cap: int) -> int:
    """The padded size of an n-request decode-only batch: 1, 2, 4, 8, then multiples of 8."""
    size = 1 << (n - 1).bit_length() if n <= 8 else -(-n // 8) * 8
    return min(size, max(cap, n))


class RequestTable:
    """Persistent host block tables `[rows, max_blocks]`, one row per live request.

    Unused entries hold the dummy block, so any gathered column is a valid block id.
    """

    def __init__(self, max_blocks_per_req: int, dummy_block: int, rows: int = 64):
        self.width, self.dummy = max_blocks_per_req, dummy_block
        self.tables = np.full((rows, max_blocks_per_req), dummy_block, dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.extend(row, block_ids)
        return row

    def extend(self, row: int, block_ids) -> None:
        n, k = int(self.num_blocks[row]), len(block_ids)
        if k:
            self.tables[row, n : n + k] = block_ids
            self.num_blocks[row] = n + k

    def free(self, row: int) -> None:
        self.tables[row, : self.num_blocks[row]] = self.dummy
        self.num_blocks[row] = 0
        self._free.append(row)

    def _grow(self) -> None:
        old = len(self.tables)
        self.tables = np.concatenate((self.tables, np.full_like(self.tables, self.dummy)))
        self.num_blocks = np.concatenate((self.num_blocks, np.zeros_like(self.num_blocks)))
        self._free = list(range(2 * old - 1, old - 1, -1))


# Fixed-offset segments of the arena: (name, capacity in units of "tokens" or "reqs").
_SEGMENTS = (("input_ids", "t"), ("positions", "t"), ("slots", "t"), ("pf_rows", "t"),
             ("seq_lens", "r"), ("logits_idx", "r"), ("ph_dst", "r"), ("ph_src", "r"))


class StepBuffers:
    """One slot's int64 arena: fixed-offset segments, then the block table and prefill index."""

    def __init__(self, device: torch.device, max_tokens: int, max_reqs: int, max_blocks_per_req: int):
        self.device = device
        self.max_tokens, self.max_reqs, self.max_blocks_per_req = max_tokens, max_reqs, max_blocks_per_req
        self.offsets, off = {}, 0
        for name, unit in _SEGMENTS:
            self.offsets[name] = off
            off += max_tokens if unit == "t" else max_reqs
        self.tail = off  # block table [rows, width], then prefill index [num_prefills, max_q]
        self._allocate(off + max_reqs * max_blocks_per_req + max_tokens)
        self.regrown = 0

    def _allocate(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        self.host_t = torch.zeros(capacity, dtype=torch.int64, pin_memory=cuda)
        self.host = self.host_t.numpy()
        self.dev = torch.zeros(capacity, dtype=torch.int64, device=self.device) if cuda else self.host_t
        self._views: dict[tuple, torch.Tensor] = {}  # device views by (offset, shape): a torch op costs µs

    def ensure(self, num_tokens: int, num_rows: int, tail: int) -> None:
        """Reallocate for a step beyond capacity: rare (the capacity is the configured token and
        sequence budget), logged by the runner via `regrown`, and it changes the addresses."""
        if num_tokens <= self.max_tokens and num_rows <= self.max_reqs and self.tail + tail <= len(self.host):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # in-flight steps may still read the old arena
        regrown = self.regrown + 1
        self.__init__(self.device, max(num_tokens, self.max_tokens), max(num_rows, self.max_reqs),
                      self.max_blocks_per_req)
        if self.tail + tail > len(self.host):
            self._allocate(self.tail + tail)
        self.regrown = regrown

    def seg(self, name: str, n: int) -> np.ndarray:
        off = self.offsets[name]
        return self.host[off : off + n]

    def tail_view(self, start: int, rows: int, cols: int) -> np.ndarray:
        """A contiguous `[rows, cols]` host array at `tail + start`."""
        off = self.tail + start
        return self.host[off : off + rows * cols].reshape(rows, cols)

    def upload(self, end: int) -> None:
        """H2D of the arena's used prefix `[0, end)`: one contiguous pinned non-blocking copy."""
        if self.dev is not self.host_t:
            self.dev[:end].copy_(self.host_t[:end], non_blocking=True)

    def dev_seg(self, name: str, n: int) -> torch.Tensor:
        key = (self.offsets[name], n)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.dev[key[0] : key[0] + n]
        return view

    def dev_tail(self, start: int, rows: int, cols: int) -> torch.Tensor:
        key = (self.tail + start, rows, cols)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.dev[key[0] : key[0] + rows * cols].view(rows, cols)
        return view


@dataclass
class BuildConfig:
    block_size: int
    dummy_block: int
    pad_decodes: bool  # pad decode-only steps to decode_bucket sizes (CUDA-graph shapes)


def step_shape(q_lens: np.ndarray, pad_decodes: bool, max_reqs: int) -> tuple[int, int, int]:
    """(num_tokens, num_rows, padding rows) of a step of real query lengths `q_lens`."""
    num_tokens = int(q_lens.sum())
    rows = len(q_lens)
    if pad_decodes and num_tokens == rows:
        padded = decode_bucket(rows, max_reqs)
        return num_tokens + padded - rows, padded, padded - rows
    return num_tokens, rows, 0


def build_inputs(buf: StepBuffers, table: RequestTable, sched: ScheduledBatch, cfg: BuildConfig,
                 prev_rows: dict[str, int]) -> StepInputs:
    """Flatten `sched` (decodes, i.e. one-token queries, first) into the arena and upload it.

    Call with the copy stream current; the caller made sure the arena is free to overwrite.
    """
    bs = cfg.block_size
    num_real = len(sched)
    states = sched.states
    q_real = np.fromiter(sched.num_scheduled, np.int64, num_real)
    num_tokens, num_rows, pad = step_shape(q_real, cfg.pad_decodes, buf.max_reqs)
    q_lens = np.ones(num_rows, dtype=np.int64)
    q_lens[:num_real] = q_real
    starts = np.zeros(num_rows, dtype=np.int64)
    starts[:num_real] = np.fromiter([st.num_computed for st in states], np.int64, num_real)
    rows = np.fromiter([st.row for st in states], np.int64, num_real)
    width = _bucket_width(int(table.num_blocks[rows].max()), table.width)
    tail_len = num_rows * width + _prefill_index_len(q_lens, num_real)
    buf.ensure(num_tokens, num_rows, tail_len)
    tables = buf.tail_view(0, num_rows, width)
    np.take(table.tables[:, :width], rows, axis=0, out=tables[:num_real])
    tables[num_real:] = cfg.dummy_block
    cu = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    ids = buf.seg("input_ids", num_tokens)
    ids[:] = 0  # placeholder and padding inputs
    _fill_ids(ids, sched, cu)
    positions = buf.seg("positions", num_tokens)
    slots = buf.seg("slots", num_tokens)
    seq_lens = buf.seg("seq_lens", num_rows)
    seq_lens[:] = starts + q_lens
    if num_tokens == num_rows:  # decode-only: one token per row
        positions[:] = starts
        slots[:] = tables[np.arange(num_rows), starts // bs] * bs + starts % bs
    else:
        req_of_token = np.repeat(np.arange(num_rows), q_lens)  # [num_tokens]
        positions[:] = np.arange(num_tokens) - cu[req_of_token] + starts[req_of_token]
        slots[:] = tables[req_of_token, positions // bs] * bs + positions % bs
    known = np.fromiter([len(st.token_ids) for st in states], np.int64, num_real)
    sampling_rows = np.flatnonzero(seq_lens[:num_real] == known)
    logits_idx = buf.seg("logits_idx", len(sampling_rows))
    logits_idx[:] = cu[1:][sampling_rows] - 1
    ph_rows = np.flatnonzero(np.fromiter(sched.placeholder, np.bool_, num_real))
    ph_dst = buf.seg("ph_dst", len(ph_rows))
    ph_dst[:] = cu[ph_rows]
    ph_src = buf.seg("ph_src", len(ph_rows))
    ph_src[:] = np.fromiter([prev_rows[states[i].request_id] for i in ph_rows.tolist()], np.int64, len(ph_rows))
    num_decodes = int(np.argmax(q_lens != 1)) if num_tokens != num_rows else num_rows
    pf_index, pf_rows, pf_shape = _prefill_index(buf, num_rows * width, cu, q_lens, num_decodes)
    buf.upload(buf.tail + tail_len)
    meta = AttentionMetadata(
        slot_mapping=buf.dev_seg("slots", num_tokens),
        positions=buf.dev_seg("positions", num_tokens),
        block_tables=buf.dev_tail(0, num_rows, width),
        seq_lens=buf.dev_seg("seq_lens", num_rows),
        num_decodes=num_decodes,
        max_decode_kv=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
        decode_uniform=bool(num_decodes) and bool(seq_lens[:num_decodes].min() == seq_lens[:num_decodes].max()),
        max_prefill_kv=int(seq_lens[num_decodes:].max()) if num_decodes < num_rows else 0,
        prefill_token_index=buf.dev_tail(num_rows * width, *pf_shape),
        prefill_rows=buf.dev_seg("pf_rows", pf_rows),
        host=HostMetadata(tables, seq_lens, cu),
    )
    return StepInputs(
        input_ids=buf.dev_seg("input_ids", num_tokens),
        meta=meta,
        logits_indices=buf.dev_seg("logits_idx", len(sampling_rows)),
        sampling_reqs=[states[i] for i in sampling_rows.tolist()],
        placeholder_dst=buf.dev_seg("ph_dst", len(ph_rows)),
        placeholder_src=buf.dev_seg("ph_src", len(ph_rows)),
        num_padding=pad,
    )


def _bucket_width(max_blocks: int, cap: int) -> int:
    """Block-table columns: the next power of two (>= 1), so shapes come from a small set."""
    return min(1 << max(max_blocks - 1, 0).bit_length(), cap) if max_blocks else 1


def _fill_ids(ids: np.ndarray, sched: ScheduledBatch, cu: np.ndarray) -> None:
    """Host-known input ids (placeholders stay 0): one slice copy per prompt chunk, one
    vectorised scatter for the non-placeholder decodes."""
    rows, toks = [], []
    for i, (st, n, ph) in enumerate(zip(sched.states, sched.num_scheduled, sched.placeholder)):
        if ph:
            continue
        if n == 1:
            rows.append(i)
            toks.append(st.token_ids[st.num_computed])
        else:
            ids[cu[i] : cu[i + 1]] = st.token_ids[st.num_computed : st.num_computed + n]
    if rows:
        ids[cu[rows]] = toks


def _prefill_index_len(q_lens: np.ndarray, num_real: int) -> int:
    pf = q_lens[:num_real][q_lens[:num_real] != 1]
    return len(pf) * int(pf.max()) if len(pf) else 0


def _prefill_index(buf: StepBuffers, tail_start: int, cu: np.ndarray, q_lens: np.ndarray,
                   num_decodes: int) -> tuple[np.ndarray, int, tuple[int, int]]:
    """Padded `[num_prefills, max_q]` token indices of the prompt-chunk requests (in the tail)."""
    pf_lens = q_lens[num_decodes:]
    num_p = len(pf_lens)
    max_q = int(pf_lens.max()) if num_p else 0
    index = buf.tail_view(tail_start, num_p, max_q)
    num_pf_tokens = int(pf_lens.sum())
    rows = buf.seg("pf_rows", num_pf_tokens)
    if num_p:
        offs = np.arange(max_q)[None, :]  # [1, max_q]
        # padded entries repeat the request's last token so no query row is fully masked
        index[:] = cu[num_decodes:-1, None] + np.minimum(offs, pf_lens[:, None] - 1)
        rows[:] = np.flatnonzero(offs < pf_lens[:, None])  # real entries, row-major = token order
    return index, num_pf_tokens, (num_p, max_q)
