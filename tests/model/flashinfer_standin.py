"""A CPU stand-in for the two `flashinfer` wrappers `worker_service/flashinfer_attention.py` calls,
computing what FlashInfer documents for them (0.7: `BatchDecodeWithPagedKVCacheWrapper`,
`BatchPrefillWithPagedKVCacheWrapper`, NHD layout) request by request in plain torch, and checking
the argument types FlashInfer's `plan` expects (int32 host tensors). It stands for the library in
the CPU tests only; the gpu tests run the real one.

Semantics (FlashInfer's docs): request r's pages are `indices[indptr[r]:indptr[r+1]]`, its keys the
first `(pages - 1) * page_size + last_page_len[r]` slots of them in order; its query tokens (prefill:
`qo_indptr[r]:qo_indptr[r+1]`, decode: one) are the last ones of those keys; `causal` lets query i
see keys up to its own position, `window_left` w >= 0 only the w keys before it as well; the logits
are `q.k * sm_scale`, soft-capped as `cap * tanh(logits / cap)` when `logits_soft_cap` > 0.
"""

from __future__ import annotations

import torch


class _Wrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.plans = 0
        self.runs = 0
        self._plan: dict | None = None

    def _check_host(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            assert t.device.type == "cpu" and t.dtype == torch.int32 and t.dim() == 1, (t.device, t.dtype, t.shape)

    def _store(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
               sm_scale, **rest) -> None:
        """Keep a plan (FlashInfer's plan copies its page metadata to the device)."""
        self._check_host(indptr, indices, last_page_len)
        self._plan = dict(indptr=indptr.clone(), indices=indices.clone(), last_page_len=last_page_len.clone(),
                          num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          page_size=page_size, sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale, **rest)
        self.plans += 1

    def _attend(self, q: torch.Tensor, paged_kv_cache, qo_indptr: list[int]) -> torch.Tensor:
        p = self._plan
        k_cache, v_cache = paged_kv_cache  # [pages, page_size, kvh, d]
        assert k_cache.shape[1] == p["page_size"] and k_cache.shape[2] == p["num_kv_heads"]
        assert q.is_contiguous() and q.shape[1] == p["num_qo_heads"] and q.dtype == p["q_data_type"]
        group = p["num_qo_heads"] // p["num_kv_heads"]
        out = torch.empty_like(q)
        indptr, indices, last = p["indptr"].tolist(), p["indices"], p["last_page_len"].tolist()
        for r in range(len(last)):
            pages = indices[indptr[r] : indptr[r + 1]].long()
            kv_len = (len(pages) - 1) * p["page_size"] + last[r]
            k = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)  # [kv_len, H, d]
            v = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
            qr = q[qo_indptr[r] : qo_indptr[r + 1]]  # [q_len, H, d]
            logits = torch.einsum("qhd,khd->hqk", qr.float(), k.float()) * p["sm_scale"]  # [H, q_len, kv_len]
            if p["logits_soft_cap"]:
                logits = torch.tanh(logits / p["logits_soft_cap"]) * p["logits_soft_cap"]
            pos = torch.arange(kv_len - len(qr), kv_len)[:, None]  # [q_len, 1] the queries' positions
            key = torch.arange(kv_len)[None, :]
            allowed = key <= pos if p["causal"] else torch.ones_like(key <= pos)
            if p["window_left"] >= 0:
                allowed &= key >= pos - p["window_left"]
            logits = logits.masked_fill(~allowed, float("-inf"))
            out[qo_indptr[r] : qo_indptr[r + 1]] = torch.einsum(
                "hqk,khd->qhd", torch.softmax(logits, dim=-1), v.float()).to(q.dtype)
        self.runs += 1
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left=-1, logits_soft_cap=None, sm_scale=None, q_data_type=None, kv_data_type=None) -> None:
        self._store(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                    window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                    q_data_type=q_data_type, causal=True)

    def run(self, q, paged_kv_cache):
        return self._attend(q, paged_kv_cache, list(range(len(self._plan["last_page_len"]) + 1)))


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, window_left=-1, logits_soft_cap=None,
             sm_scale=None, q_data_type="float16", kv_data_type=None) -> None:
        self._check_host(qo_indptr)
        self._store(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                    head_dim_qk, page_size, window_left=window_left, logits_soft_cap=logits_soft_cap,
                    sm_scale=sm_scale, q_data_type=q_data_type, causal=causal, qo_indptr=qo_indptr.clone())

    def run(self, q, paged_kv_cache):
        assert q.shape[0] == int(self._plan["qo_indptr"][-1])
        return self._attend(q, paged_kv_cache, self._plan["qo_indptr"].tolist())
