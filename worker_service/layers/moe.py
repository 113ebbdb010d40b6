"""Mixture of Experts: a softmax router over E experts, each token's top-k, and the experts
stacked per layer (SwiGLU), run batched per expert.

The (token, expert) pairs are sorted by expert, and each expert that has tokens runs one
gate_up matmul and one down matmul over its rows; the rows' weighted outputs go back to
(token, slot) order and each token's k rows are summed. The loop is over experts (E iterations
at most), never over tokens. The rows per expert are read to the host once per layer (a
synchronisation; a fused grouped-GEMM kernel would avoid it on a GPU).

Under tensor parallelism `worker_service/parallel/layers.py` RowParallelExperts (a subclass)
holds 1/k of every expert's width, or with expert parallelism a contiguous share of whole
experts (`first`, `num_experts` < `total`), and all-reduces the weighted sum once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MoEExperts(nn.Module):
    """Experts [first, first + num_experts) of the layer's, SwiGLU, stacked: gate_up_proj
    [2E, I, hidden] (local expert j's gate rows at 2j, up at 2j + 1), down_proj [E, hidden, I].
    All of the layer's experts (first 0) unless expert parallelism gave this rank a share; under
    TP without it, I is this rank's share of every expert's width (RowParallelExperts)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, first: int = 0, total: int | None = None):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.first = num_experts, hidden, intermediate, first
        self.total = num_experts if total is None else total  # the layer's experts (the router's E)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [n, hidden]; weights, experts [n, k] (each token's top-k, the layer's expert ids):
        Σ_j weights[:, j] * expert_j(x) over the slots whose expert is held here (zero for the others)."""
        n, k = experts.shape
        held = self.num_experts
        flat = experts.reshape(-1) - self.first  # [n * k] (token, slot) pairs, token-major; local ids
        if held < self.total:  # a share of the experts (EP): the other experts' pairs go last
            flat = torch.where((flat >= 0) & (flat < held), flat, held)
        order = flat.argsort(stable=True)  # the pairs grouped by expert, pairs of experts not held last
        counts = torch.bincount(flat, minlength=held + 1).tolist()  # rows per expert (one host sync)
        mine = n * k - counts[held]  # pairs computed here
        order_mine = order[:mine]
        rows = x[order_mine // k]  # [mine, hidden] each sorted pair's token
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts[:held]):
            if not count:
                continue
            seg = rows[start:start + count]  # [count, hidden]
            gate, up = F.linear(seg, self.gate_up_proj[2 * e:2 * e + 2].reshape(-1, self.hidden)).split(
                self.intermediate, dim=-1)  # [count, I] each
            out[start:start + count] = F.linear(F.silu(gate) * up, self.down_proj[e])  # [count, hidden]
            start += count
        weighted = (out * weights.reshape(-1)[order_mine].unsqueeze(-1)).to(x.dtype)  # [mine, hidden], sorted
        # back in (token, slot) order (zero rows for pairs not held), each token's k rows summed
        # (cheaper than index_add_ on CPU)
        back = torch.empty_like(weighted) if mine == n * k else weighted.new_zeros(n * k, weighted.shape[-1])
        return back.index_copy_(0, order_mine, weighted).view(n, k, -1).sum(dim=1)  # [n, hidden]


class SparseMoeBlock(nn.Module):
    """Router + experts, `[n, hidden]` -> `[n, hidden]`: softmax over the E experts (float32), the
    top-k, renormalised to sum to one when `renormalize`; `cast_weights`: the routing weights in
    x's dtype before the experts weigh by them (Qwen3-MoE), else float32 products (Mixtral).
    This module holds experts [first_local, first_local + num_local) of the E (all of them
    unless expert parallelism shares them out)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, *, renormalize: bool,
                 cast_weights: bool, num_local: int | None = None, first_local: int = 0):
        super().__init__()
        self.top_k, self.renormalize, self.cast_weights = top_k, renormalize, cast_weights
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # router weight: [E, hidden]
        self.experts = MoEExperts(num_experts if num_local is None else num_local, hidden, intermediate,
                                  first_local, num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, k] each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            weights = weights.to(x.dtype)
        return self.experts(x, weights, experts)
