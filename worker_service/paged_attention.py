"""Paged decode-attention backends beside the torch reference, and the `--attention-backend`
registry.

`CpuDecodeBackend` (`auto` on CPU float32) decodes with the C++ kernel of
`worker_service/cpu_kernels.py`, straight over the paged cache; prompts take the reference path.

`PagedDecodeBackend` attends each decode over its block table and sequence length *on the
device*: the shapes of its kernels depend only on the batch rows and the block-table width
(both bucketed by the input builder), never on host scalars such as the longest sequence
of the step, so a decode step can be captured into a CUDA graph and replayed with new
tables and lengths. Prompt chunks use the torch reference path.

Kernel: flash-attn's paged KV path (`flash_attn_with_kvcache` with `block_table`) when the
package is installed, the device is CUDA, the dtype half precision and the block size a
multiple of 256 (flash-attn 2's page-size rule); the torch path (gather the table's
blocks, mask keys at or beyond `seq_len` and, in a sliding-window layer, those at or before
`seq_len - 1 - window`, SDPA or soft-capped attention) otherwise. flash-attn takes the window as
`window_size=(window - 1, 0)` and the soft-cap as `softcap` (0: none); a layer with attention
sinks decodes by the torch path (flash-attn 2 has no sinks). The cache layout
`[blocks, block_size, kv_heads, head_dim]` is the one flash-attn expects.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from worker_service.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, attention, decode_mask
from worker_service.attention_names import AttentionBackendName
from worker_service import cpu_kernels

log = logging.getLogger(__name__)

FLASH_ATTN_PAGE_MULTIPLE = 256


class PagedDecodeBackend(TorchAttentionBackend):
    """Decode from `block_tables` and `seq_lens` on the device (see the module docstring)."""

    graph_safe = True  # a decode step's kernels depend on its rows and table width only (decode_graphs.py)

    def __init__(self, use_flash_attn: bool = False):
        super().__init__()
        self._flash = None
        if use_flash_attn:
            from flash_attn import flash_attn_with_kvcache  # checked by flash_attn_usable()

            self._flash = flash_attn_with_kvcache

    @property
    def kernel(self) -> str:
        return "flash-attn" if self._flash is not None else "torch"

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, window, softcap, sinks=None):
        # q: [nd, heads, d]; tables [nd, W] and seq_lens [nd] are device tensors
        nd = q.shape[0]
        tables, seq_lens = meta.block_tables[:nd], meta.seq_lens[:nd]
        if self._flash is not None and sinks is None:  # not run by the CPU tests
            out = self._flash(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=seq_lens.to(torch.int32),
                              block_table=tables.to(torch.int32), softmax_scale=scale, causal=True,
                              window_size=(-1, -1) if window is None else (window - 1, 0),
                              softcap=0.0 if softcap is None else softcap)
            return out.squeeze(1)  # [nd, heads, d]
        width = tables.shape[1]
        s_len = width * k_cache.shape[1]
        k, v = self._buffer.gather_blocks(k_cache, v_cache, tables.reshape(-1), nd, s_len)  # [nd, kvh, S, d]
        mask = decode_mask(seq_lens, s_len, window)  # [nd, 1, 1, S]
        qg = q.view(nd, k.shape[1], -1, q.shape[-1])  # [nd, kvh, group, d]
        return attention(qg, k, v, mask, scale, softcap, sinks).reshape(q.shape)


class CpuDecodeBackend(TorchAttentionBackend):
    """Decodes with the CPU paged-decode kernel (one pass over each request's blocks, no gather), and
    writes each step's K/V with the kernels' `write_kv`."""

    def __init__(self, kernel=None):
        super().__init__()
        if kernel is None:
            kernel = cpu_kernels.load()
            if kernel is None:
                raise RuntimeError("the CPU paged-decode kernel could not be built (the warning above says why)")
        self._kernel = kernel  # the module `cpu_kernels.load()` returned

    def write_kv(self, k, v, k_cache, v_cache, meta):
        # k, v: [num_tokens, kv_heads, head_dim] -> their slots of the caches, one kernel call
        self._kernel.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, window, softcap, sinks=None):
        # q: [nd, heads, d]; the first nd rows of block_tables [*, W] and seq_lens [*]
        nd = q.shape[0]
        return cpu_kernels.paged_decode(self._kernel, q, k_cache, v_cache, meta.block_tables[:nd],
                                        meta.seq_lens[:nd], scale, window, softcap, sinks)


def flash_attn_usable(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and block_size % FLASH_ATTN_PAGE_MULTIPLE == 0
            and importlib.util.find_spec("flash_attn") is not None)


def make_backend(name: AttentionBackendName, device: torch.device, dtype: torch.dtype,
                 block_size: int, *, graphs: bool = False) -> AttentionBackend:
    """The backend `--attention-backend name` means here; `graphs`: decode steps will be replayed from
    CUDA graphs (decode_graphs.py), which `auto` answers with the graph-safe paged backend."""
    if name is AttentionBackendName.AUTO and not graphs:
        kernel = cpu_kernels.load() if cpu_kernels.usable(device, dtype) else None
        return CpuDecodeBackend(kernel) if kernel is not None else TorchAttentionBackend()
    if name is AttentionBackendName.TORCH:
        return TorchAttentionBackend()
    if name is AttentionBackendName.FLASHINFER:
        from worker_service.flashinfer_attention import FlashInferBackend, flashinfer_usable

        why = flashinfer_usable(device, dtype)
        if why is not None:
            raise ValueError(why)
        log.info("attention backend flashinfer")
        return FlashInferBackend(device)
    backend = PagedDecodeBackend(use_flash_attn=flash_attn_usable(device, dtype, block_size))
    log.info("attention backend paged, decode kernel %s", backend.kernel)
    return backend
