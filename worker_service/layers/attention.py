"""Attention over the paged KV cache, and the per-step context every layer is given.

`Attention` is the Llama-shaped block (HF's q/k/v projections fused into `qkv_proj`, `o_proj`)
with the options the families differ by: biases, a q/k RMSNorm per head (Qwen3, Gemma 3) or
over the whole projection width (OLMo 2), rotary positions (the sliding layers' own table where
the runner built one: Gemma 3), a sliding window, logit soft-capping (Gemma 2), a query scale
other than head_dim^-1/2 (Gemma's query_pre_attn_scalar) and attention sinks.

Sinks (gpt-oss): a learned logit per query head that joins the softmax's denominator and
attends to no value, so a head can put weight "nowhere":
`out = Σ_j exp(l_j) v_j / (Σ_j exp(l_j) + exp(sink_h))` over the keys j the query sees. The
backends take them per `attend` call (`worker_service/attention.py`).

`paged_attention` is the part after the projections (write this step's K/V, attend), for a
family that projects q/k/v itself (GPT-2's `c_attn`). Under `torch.compile` it is one opaque
op, `torch.ops.stepahead.paged_attention`, that finds the step's context where the compiled
forward put it (`current_context`): the layers' dense parts compile, the paged attention
(host scalars, per-step metadata, a C++ kernel) runs as it does eagerly (vLLM's piecewise split).
It is given its layer as a 0-d host tensor (`layer_key`), a graph input rather than an int
constant, so the decoder layers, identical but for their weights and their index, share one
compiled graph (`worker_service/compiled.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from worker_service.attention import AttentionBackend, AttentionMetadata
from worker_service.cpu_kernels import layer_ops
from worker_service.layers.rotary import apply_rotary


@dataclass
class ForwardContext:
    """Everything a layer needs besides its hidden states, built once per step."""

    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) [blocks, block_size, kvh, d]
    # None for a family without rope (`ModelFamily.rope`: GPT-2 embeds meta.positions itself)
    cos: torch.Tensor | None  # [num_tokens, 1, head_dim]
    sin: torch.Tensor | None  # [num_tokens, 1, head_dim], first half negated (RotaryTable.lookup)
    # the sliding layers' cos/sin where their rope differs (Gemma 3's rope_local_base_freq); else None
    local_cos: torch.Tensor | None = None  # [num_tokens, 1, head_dim]
    local_sin: torch.Tensor | None = None  # [num_tokens, 1, head_dim]


_current: list[ForwardContext] = []  # the context of the compiled forward running now (one at most)


@contextlib.contextmanager
def current_context(ctx: ForwardContext) -> Iterator[None]:
    """Make `ctx` the one the compiled forward's attention ops read, for the duration of a forward."""
    if _current:
        raise RuntimeError("a compiled forward is already running")
    _current.append(ctx)
    try:
        yield
    finally:
        _current.pop()


def layer_key(layer_idx: int) -> torch.Tensor:
    """Layer `layer_idx` as `paged_attention` is told it: a 0-d int64 tensor on the host (a
    module's plain attribute, so it stays there when the model is on a device)."""
    return torch.tensor(layer_idx, dtype=torch.int64, device="cpu")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: torch.Tensor,
                    scale: float, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q `[n, H, d]`, k and v `[n, KVH, d]` (rotated already) -> `[n, H, d]`: this step's K/V
    written into the cache of layer `layer` (`layer_key`), then each query attends over its
    request's keys (`window`: the last `window` positions only; `softcap`: scores soft-capped;
    `sinks` `[H]`)."""
    if torch.compiler.is_compiling():  # traced: one opaque op; `ctx` is the one current_context holds
        return torch.ops.stepahead.paged_attention(q, k, v, layer, scale, window, softcap, sinks)
    k_cache, v_cache = ctx.kv_caches[int(layer)]
    ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.meta)
    return ctx.backend.attend(q, k_cache, v_cache, ctx.meta, scale, window, softcap, sinks=sinks)


@torch.library.custom_op("stepahead::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float,
                        window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    # writes the layer's KV cache, which is no input of the graph (the caches live in the context)
    if not _current:
        raise RuntimeError("stepahead::paged_attention ran outside current_context()")
    return paged_attention(q, k, v, _current[0], layer, scale, window, softcap, sinks)


@_paged_attention_op.register_fake
def _(q, k, v, layer, scale, window, softcap, sinks):
    return torch.empty_like(q)  # [n, H, d]


class Attention(nn.Module):
    """Rotary multi-head attention with grouped KV heads (H a multiple of KVH), `[n, hidden]` ->
    `[n, hidden]`. With the CPU layer kernels attached (`cpu_ops`), the rotation is one in-place pass.

    `qk_norm(dim)` builds the q and k norms: over each head (dim d) when `qk_norm_per_head`,
    else over the whole q `[n, H * d]` and k `[n, KVH * d]` projections (OLMo 2). `local_rope`:
    this layer rotates by the context's local table when there is one (Gemma 3's sliding layers).
    """

    cpu_ops: ModuleType | None = None  # the CPU layer kernels, where the runner attached them (cpu_kernels.py)

    def __init__(self, layer_idx: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 scale: float | None = None, qkv_bias: bool = False, o_bias: bool = False, window: int | None = None,
                 softcap: float | None = None, qk_norm: Callable[[int], nn.Module] | None = None,
                 qk_norm_per_head: bool = True, local_rope: bool = False, sinks: bool = False):
        super().__init__()
        self.layer = layer_key(layer_idx)  # [] int64, on the host
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window, self.softcap, self.local_rope = window, softcap, local_rope  # window None: every earlier key
        # qkv_proj.weight: [q_size + 2 * kv_size, hidden] (q | k | v); o_proj.weight: [hidden, q_size]
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=o_bias)
        self.qk_norm_per_head = qk_norm_per_head
        self.q_norm = self.k_norm = None
        if qk_norm is not None:  # weights: [d] each per head; else [H * d] and [KVH * d]
            self.q_norm = qk_norm(head_dim if qk_norm_per_head else self.q_size)
            self.k_norm = qk_norm(head_dim if qk_norm_per_head else self.kv_size)
        # sinks: [H] one logit per query head (gpt-oss's `self_attn.sinks`)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # x: [n, hidden]
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qk, v = self.project(x)  # [n, H + KVH, d], [n, KVH, d]
        cos, sin = ctx.cos, ctx.sin
        if self.local_rope and ctx.local_cos is not None:
            cos, sin = ctx.local_cos, ctx.local_sin
        ops = layer_ops(self, qk)
        if ops is not None and cos.shape[-1] == qk.shape[-1]:
            ops.rotary_(qk, cos, sin)  # in place: qk is this step's own projection (or its norm)
            q, k = qk.split_with_sizes((heads, kv_heads), 1)  # [n, H, d], [n, KVH, d]
        else:
            q, k = apply_rotary(qk, cos, sin).split((heads, kv_heads), dim=1)  # one rotation: [n, H, d], [n, KVH, d]
        out = paged_attention(q, k, v, ctx, self.layer, self.scale, self.window, self.softcap,
                              self.sinks)  # [n, H, d]
        return self.o_proj(out.reshape(n, self.q_size))

    def accepts_cpu_ops(self) -> bool:
        return True  # the rotary kernel (a partial rotary takes the torch ops)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k `[n, H + KVH, d]` (q/k-normed, before rope) and v `[n, KVH, d]`."""
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]
        if self.q_norm is not None and not self.qk_norm_per_head:  # over the whole width
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)  # [n, H*d] [n, KVH*d] [n, KVH*d]
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-1).view(n, heads + kv_heads, d)
            return qk, v.view(n, kv_heads, d)
        qk = qkv[:, : self.q_size + self.kv_size].view(n, heads + kv_heads, d)  # [n, H + KVH, d]
        v = qkv[:, self.q_size + self.kv_size :].view(n, kv_heads, d)  # [n, KVH, d]
        if self.q_norm is not None:  # per head
            q, k = qk.split((heads, kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        return qk, v
