"""FlashInfer's paged attention kernels (`--attention-backend flashinfer`: CUDA, with the optional
`flashinfer-python` package installed; never required).

FlashInfer reads the paged cache in place at any page size, so it runs at the default block size
16, where flash-attn's paged path needs a multiple of 256 (`paged_attention.py`). The cache
layout `[blocks, block_size, kv_heads, head_dim]` is FlashInfer's `NHD`. A step's decodes go
through `BatchDecodeWithPagedKVCacheWrapper`, its prompt chunks through
`BatchPrefillWithPagedKVCacheWrapper` (causal, each chunk's queries aligned to the end of its
keys). Each wrapper is *planned* once per step on the host, from the step's block tables and
lengths (`AttentionMetadata.host`: numpy views the input builder already filled, so planning
needs no device-to-host copy), and then *run* by every layer. FlashInfer's page metadata: per
request its used blocks in order (`indices`, delimited by `indptr`) and the fill of its last
one (`last_page_len`); `paged_kv` builds them.

Per layer: a sliding window is FlashInfer's `window_left = window - 1` (the query and the
window - 1 keys before it, as `attention.py` defines a window), soft-capping its
`logits_soft_cap`, the query scale its `sm_scale`. A wrapper is planned for each
(window, soft-cap, scale) the step's layers use (Gemma 2 and 3 alternate two windows). A
layer with attention sinks attends by the torch reference path.

Planning runs on the host, so this backend's steps are not captured into CUDA graphs
(`graph_safe` False: `--no-enforce-eager` keeps the compiled forward without graphs). It has
not run on a GPU yet: `tests/model/test_flashinfer_attention.py` checks the metadata and the
calls on CPU against a stand-in that computes what FlashInfer documents for them, and
`tests/gpu/test_cuda_runner.py` compares it with the torch path on a device.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from worker_service.attention import AttentionMetadata, TorchAttentionBackend

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-k partial results)


def flashinfer_usable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when `--attention-backend flashinfer` can run on `device` in `dtype`, else why not (one line)."""
    if device.type != "cuda":
        return f"--attention-backend flashinfer runs on CUDA only, not on --device {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"--attention-backend flashinfer needs --dtype float16 or bfloat16, not {dtype}"
    if importlib.util.find_spec("flashinfer") is None:
        return "--attention-backend flashinfer: the flashinfer-python package is not installed"
    return None


@dataclass(frozen=True)
class PagedKV:
    """FlashInfer's page metadata of some requests (host, int32)."""

    indptr: torch.Tensor  # [n + 1]: request r's pages are indices[indptr[r] : indptr[r + 1]]
    indices: torch.Tensor  # [indptr[-1]]: block ids, each request's in order
    last_page_len: torch.Tensor  # [n]: tokens in each request's last page (1..block_size)


def paged_kv(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> PagedKV:
    """The page metadata of requests with block tables `tables` `[n, W]` and `seq_lens` `[n]` (>= 1)."""
    pages = -(-seq_lens // block_size)  # [n]
    indptr = np.zeros(len(pages) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(tables.shape[1])[None, :] < pages[:, None]  # [n, W]
    indices = tables[used].astype(np.int32)  # row-major: each request's blocks in order
    last = (seq_lens - (pages - 1) * block_size).astype(np.int32)
    return PagedKV(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last))


class FlashInferBackend(TorchAttentionBackend):
    """Decode and prefill by FlashInfer's paged kernels (see the module docstring); K/V writes and
    layers with sinks by the torch reference."""

    graph_safe = False  # planned on the host every step

    def __init__(self, device: torch.device, module: ModuleType | None = None):
        super().__init__()
        self._fi = module if module is not None else importlib.import_module("flashinfer")
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[tuple, object] = {}  # (part, window, softcap, scale) -> wrapper
        self._step: AttentionMetadata | None = None  # the step the wrappers were planned for
        self._planned: set[tuple] = set()
        self._page_meta: dict[str, PagedKV] = {}  # this step's, per part

    @property
    def kernel(self) -> str:
        return "flashinfer"

    def attend(self, q, k_cache, v_cache, meta, scale, window=None, softcap=None, *, sinks=None):
        # q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]
        if sinks is not None or meta.host is None:
            return super().attend(q, k_cache, v_cache, meta, scale, window, softcap, sinks=sinks)
        if meta is not self._step:
            self._step, self._planned, self._page_meta = meta, set(), {}
        nd, n = meta.num_decodes, q.shape[0]
        parts = []
        if nd:
            parts.append(self._run("decode", q[:nd], k_cache, v_cache, meta, scale, window, softcap))
        if nd < n:
            parts.append(self._run("prefill", q[nd:], k_cache, v_cache, meta, scale, window, softcap))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _run(self, part: str, q, k_cache, v_cache, meta: AttentionMetadata, scale, window, softcap):
        key = (part, window, softcap, scale)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            cls = (self._fi.BatchDecodeWithPagedKVCacheWrapper if part == "decode"
                   else self._fi.BatchPrefillWithPagedKVCacheWrapper)
            wrapper = self._wrappers[key] = cls(self._workspace, kv_layout="NHD")
        if key not in self._planned:
            self._plan(part, wrapper, q, k_cache, meta, scale, window, softcap)
            self._planned.add(key)
        return wrapper.run(q.contiguous(), (k_cache, v_cache))  # [rows' tokens, heads, head_dim]

    def _plan(self, part: str, wrapper, q, k_cache, meta: AttentionMetadata, scale, window, softcap) -> None:
        host, nd = meta.host, meta.num_decodes
        rows = slice(0, nd) if part == "decode" else slice(nd, len(host.seq_lens))
        pages = self._page_meta.get(part)
        if pages is None:
            pages = self._page_meta[part] = paged_kv(host.block_tables[rows], host.seq_lens[rows], k_cache.shape[1])
        common = dict(num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[2], page_size=k_cache.shape[1],
                      window_left=-1 if window is None else window - 1,
                      logits_soft_cap=0.0 if softcap is None else softcap, sm_scale=scale,
                      q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        if part == "decode":
            wrapper.plan(pages.indptr, pages.indices, pages.last_page_len, head_dim=q.shape[2], **common)
        else:
            start = host.query_start[nd:]  # [num_prefills + 1], offsets from the step's first token
            qo_indptr = torch.from_numpy((start - start[0]).astype(np.int32))
            wrapper.plan(qo_indptr, pages.indptr, pages.indices, pages.last_page_len, head_dim_qk=q.shape[2],
                         causal=True, **common)
