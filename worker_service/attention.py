"""Paged attention behind a small backend interface, with a torch reference implementation.

The runner orders each step's requests decodes first (one query token each), then prompt
chunks. `AttentionMetadata` describes that flattened batch; a backend writes the step's K/V
into the paged cache at `slot_mapping` and attends each query over its request's blocks.

Per layer, `attend` takes a sliding window and a logit soft-cap:
- `window` (None: every earlier key): a query at position p sees the keys at positions
  p - window < k <= p, Hugging Face's convention (`masking_utils.sliding_window_overlay`:
  `kv_idx > q_idx - sliding_window`), the query itself and the window - 1 keys before it;
- `softcap` (None: none; Gemma 2's `attn_logit_softcapping`): scores become
  `softcap * tanh(scores / softcap)` before the mask and the softmax (float32), as HF's eager
  attention does. SDPA has no soft-cap, so those layers attend by explicit matmuls;
- `sinks` (None: none; gpt-oss's learned `[heads]` logits, `worker_service/layers/attention.py`):
  one more logit per query head in the softmax's denominator, attending to no value (explicit
  matmuls too, the softmax in float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One step's attention inputs. Build a new object per step: backends may cache data derived
    from it (TorchAttentionBackend's decode chunks) for the step's layers, keyed on its identity."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset per token
    positions: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64 (padded with block 0)
    seq_lens: torch.Tensor  # [num_reqs] int64: tokens in the cache after this step
    num_decodes: int  # the first num_decodes requests/tokens are single-token decodes
    max_decode_kv: int  # max seq_len over the decodes (0 when none)
    decode_uniform: bool  # every decode has seq_len == max_decode_kv (no mask needed)
    # prefill part (requests num_decodes.., tokens num_decodes..):
    prefill_token_index: torch.Tensor  # [num_prefills, max_q] int64 into the flat tokens (padded)
    prefill_rows: torch.Tensor  # [num_prefill_tokens] int64: the unpadded entries of the flattened index
    max_prefill_kv: int  # max seq_len over the prefills (0 when none)
    # the same step on the host, for a backend that plans its kernels there (FlashInfer); None: not built
    host: HostMetadata | None = None


@dataclass(frozen=True)
class HostMetadata:
    """A step's block tables, lengths and query offsets as host arrays (views of the pinned input
    arena on CUDA: valid while the step is launched, rewritten two steps later)."""

    block_tables: np.ndarray  # [num_reqs, W] int64
    seq_lens: np.ndarray  # [num_reqs] int64: tokens in the cache after this step
    query_start: np.ndarray  # [num_reqs + 1] int64: request r's tokens are [query_start[r], query_start[r + 1])


class AttentionBackend(Protocol):
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None: ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None, softcap: float | None = None, *,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over `[b, kvh, L, d]` queries and `[b, kvh, S, d]` keys/values, `mask` `[b, 1, L, S]` bool
    (True: attend; None: all); with `softcap`, HF's eager soft-capped attention instead; with
    `sinks` `[kvh * group]` (query head h = kv head h // group), each query row r of kv head i
    (head i * group + r % group: a KV group's heads folded into L) adds exp(sink) to its softmax's
    denominator."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, kvh, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [b, kvh, L, S]
        return torch.matmul(probs, v)  # [b, kvh, L, d]
    b, kvh, rows, _ = scores.shape
    group = sinks.shape[0] // kvh
    sink = sinks.float().view(kvh, 1, group).expand(kvh, rows // group, group).reshape(1, kvh, rows, 1)
    logits = torch.cat((scores.float(), sink.expand(b, -1, -1, -1)), dim=-1)  # [b, kvh, L, S + 1]
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)  # [b, kvh, L, S]: the sink's share dropped
    return torch.matmul(probs, v)  # [b, kvh, L, d]


def decode_mask(seq_lens: torch.Tensor, s_len: int, window: int | None) -> torch.Tensor:
    """`[n, 1, 1, S]` bool: the keys each decode (query position seq_len - 1) attends to."""
    key_idx = torch.arange(s_len, device=seq_lens.device)  # [S]
    mask = key_idx[None, :] < seq_lens[:, None]  # [n, S]
    if window is not None:
        mask &= key_idx[None, :] >= seq_lens[:, None] - window  # key > (seq_len - 1) - window
    return mask[:, None, None, :]


# CPU decode attends in chunks of requests whose gathered K+V take about this many bytes, so
# each chunk is still in the last-level cache when SDPA reads it (one DRAM pass over the KV
# instead of three: read cache, write gather buffer, read it back).
CPU_DECODE_CHUNK_BYTES = 4 << 20


@dataclass
class _DecodeChunk:
    """A run of decode requests attended together; derived once per step, used by every layer."""

    start: int
    end: int
    blocks: torch.Tensor  # [(end - start) * num_blocks] int64: the requests' block ids, row-major
    mask: torch.Tensor | None  # [end - start, 1, 1, S] bool (key < seq_len); None when lengths are uniform
    # per sliding window: [end - start, 1, 1, S] bool (seq_len - window <= key < seq_len), built on first use
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend:
    """Reference paged attention: gather each request's blocks, then SDPA (CPU and CUDA).

    GQA without expanding K/V: the query heads of one KV group are folded into the query
    length axis, so SDPA sees `[reqs, kv_heads, q_len * group, head_dim]` queries.
    """

    graph_safe = False  # its decode shapes follow host scalars of the step (decode_graphs.py needs True)

    def __init__(self, cpu_decode_chunk_bytes: int = CPU_DECODE_CHUNK_BYTES):
        if cpu_decode_chunk_bytes < 1:
            raise ValueError(f"cpu_decode_chunk_bytes must be positive, got {cpu_decode_chunk_bytes}")
        self._buffer = _GatherBuffer()
        self.cpu_decode_chunk_bytes = cpu_decode_chunk_bytes
        self._chunks_meta: AttentionMetadata | None = None  # the step the cached chunks were built for
        self._chunks_geometry: tuple = ()
        self._chunks: list[_DecodeChunk] = []

    def write_kv(self, k, v, k_cache, v_cache, meta):
        # k, v: [num_tokens, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]
        # 2-D views: index_copy_/index_select take a row-memcpy fast path on 2-D tensors
        n, row = k.shape[0], k_cache.shape[2] * k_cache.shape[3]
        k_cache.view(-1, row).index_copy_(0, meta.slot_mapping, k.reshape(n, row))
        v_cache.view(-1, row).index_copy_(0, meta.slot_mapping, v.reshape(n, row))

    def attend(self, q, k_cache, v_cache, meta, scale, window=None, softcap=None, *, sinks=None):
        # q: [num_tokens, heads, head_dim] -> out [num_tokens, heads, head_dim]; sinks: [heads] or None
        nd = meta.num_decodes
        if nd == q.shape[0]:
            return self._decode(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
        prefill = self._prefill(q, k_cache, v_cache, meta, scale, window, softcap, sinks)  # [num_tokens - nd, heads, d]
        if nd == 0:
            return prefill
        return torch.cat((self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, sinks), prefill))

    def _decode(self, q, k_cache, v_cache, meta, scale, window, softcap, sinks=None):
        """Outputs `[num_decodes, heads, head_dim]`; on CPU in cache-sized chunks of requests."""
        chunks = self._decode_chunks(meta, k_cache, q.device)
        if len(chunks) == 1:
            return self._decode_part(q, k_cache, v_cache, meta, scale, chunks[0], window, softcap, sinks)
        out = torch.empty_like(q)  # [nd, heads, d]
        for c in chunks:
            out[c.start : c.end] = self._decode_part(q[c.start : c.end], k_cache, v_cache, meta, scale, c, window,
                                                     softcap, sinks)
        return out

    def _decode_chunks(self, meta: AttentionMetadata, k_cache: torch.Tensor, device: torch.device):
        """The step's decode chunks, built by its first layer (holding `meta` keeps its id unique)."""
        # the scalars guard (cheaply) against a metadata object reused across steps
        geometry = (k_cache.shape[1:], k_cache.dtype, device, meta.num_decodes, meta.max_decode_kv,
                    meta.decode_uniform)
        if meta is not self._chunks_meta or geometry != self._chunks_geometry:
            self._chunks = self._build_decode_chunks(meta, k_cache, device)
            self._chunks_meta, self._chunks_geometry = meta, geometry
        return self._chunks

    def _build_decode_chunks(self, meta, k_cache, device) -> list[_DecodeChunk]:
        nd, max_kv = meta.num_decodes, meta.max_decode_kv
        num_blocks = -(-max_kv // k_cache.shape[1])
        size = nd
        if device.type == "cpu":
            req_bytes = 2 * num_blocks * k_cache[0].numel() * k_cache.element_size()
            size = max(1, self.cpu_decode_chunk_bytes // req_bytes)
        mask = None
        if not meta.decode_uniform:
            mask = decode_mask(meta.seq_lens[:nd], max_kv, None)  # [nd, 1, 1, S]
        chunks = []
        for start in range(0, nd, size):
            end = min(start + size, nd)
            blocks = meta.block_tables[start:end, :num_blocks].reshape(-1)  # [(end - start) * num_blocks]
            chunks.append(_DecodeChunk(start, end, blocks, None if mask is None else mask[start:end]))
        return chunks

    def _decode_part(self, q, k_cache, v_cache, meta, scale, chunk: _DecodeChunk, window, softcap, sinks=None):
        """Decodes one chunk; q `[n, heads, d]` -> out of the same shape."""
        n = chunk.end - chunk.start
        k, v = self._buffer.gather_blocks(k_cache, v_cache, chunk.blocks, n, meta.max_decode_kv)  # [n, kvh, S, d]
        qg = q.view(n, k.shape[1], -1, q.shape[-1])  # [n, kvh, group, d]: a decode's group is its query axis
        mask = chunk.mask
        if window is not None and window < meta.max_decode_kv:  # else no key falls outside the window
            mask = chunk.window_masks.get(window)
            if mask is None:
                mask = chunk.window_masks[window] = decode_mask(meta.seq_lens[chunk.start : chunk.end],
                                                                meta.max_decode_kv, window)
        return attention(qg, k, v, mask, scale, softcap, sinks).reshape(q.shape)

    def _prefill(self, q, k_cache, v_cache, meta, scale, window, softcap, sinks=None):
        """Outputs `[num_tokens - num_decodes, heads, head_dim]` of the prefill tokens, in order."""
        nd = meta.num_decodes
        index = meta.prefill_token_index  # [np, max_q]
        num_p, max_q = index.shape
        num_blocks = -(-meta.max_prefill_kv // k_cache.shape[1])
        blocks = meta.block_tables[nd:, :num_blocks].reshape(-1)  # [np * num_blocks]
        k, v = self._buffer.gather_blocks(k_cache, v_cache, blocks, num_p, num_blocks * k_cache.shape[1])
        kvh, head_dim = k.shape[1], q.shape[-1]
        group = q.shape[1] // kvh
        qp = q[index].view(num_p, max_q, kvh, group, head_dim)  # [np, max_q, kvh, group, d]
        qp = qp.permute(0, 2, 1, 3, 4).reshape(num_p, kvh, max_q * group, head_dim)
        q_pos = meta.positions[index]  # [np, max_q]; padded rows repeat a real token
        key_idx = torch.arange(k.shape[2], device=q.device)
        mask = key_idx[None, None, :] <= q_pos[:, :, None]  # [np, max_q, S]
        if window is not None:
            mask &= key_idx[None, None, :] > q_pos[:, :, None] - window
        mask = mask.repeat_interleave(group, dim=1)[:, None]  # [np, 1, max_q*group, S]
        o = attention(qp, k, v, mask, scale, softcap, sinks)
        o = o.view(num_p, kvh, max_q, group, head_dim).permute(0, 2, 1, 3, 4)  # [np, max_q, kvh, group, d]
        # padded rows dropped; requests' tokens are contiguous, so this is the flat token order
        return o.reshape(num_p * max_q, -1, head_dim).index_select(0, meta.prefill_rows)


class _GatherBuffer:
    """One reusable `[2, capacity]` buffer for gathered K and V (grown geometrically).

    Reuse is safe because a gathered K/V is dead before the next gather (one layer, one
    part of the batch at a time). Fresh multi-MB tensors per layer would be mmapped and
    page-faulted by the allocator at every step.
    """

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def gather_blocks(self, k_cache, v_cache, blocks, reqs: int, s_len: int):
        """K, V `[reqs, kv_heads, s_len, head_dim]` (strided views) of `blocks` `[reqs * nb]`,
        each request's `nb` blocks in order; `s_len <= nb * block_size`."""
        row = k_cache.shape[1] * k_cache.shape[2] * k_cache.shape[3]  # one block
        rows = blocks.shape[0]
        kv = self._ensure(2 * rows * row, k_cache)[: 2 * rows * row].view(2, rows, row)
        # 2-D views: index_select takes a row-memcpy fast path on 2-D tensors
        torch.index_select(k_cache.view(k_cache.shape[0], row), 0, blocks, out=kv[0])
        torch.index_select(v_cache.view(v_cache.shape[0], row), 0, blocks, out=kv[1])
        kv = kv.view(2, reqs, -1, k_cache.shape[2], k_cache.shape[3])[:, :, :s_len]  # [2, reqs, S, kvh, d]
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2)

    def _ensure(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buf
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            self.buf = buf = torch.empty(1 << (numel - 1).bit_length(), dtype=like.dtype, device=like.device)
        return buf
