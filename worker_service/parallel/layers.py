"""The layers that differ on a tensor-parallel rank. Each keeps `weight`/`bias` names, so
the loader fills them like the single-device modules they replace.

Every rank runs the same ops on the same token batch; the collectives below are the only
communication of a forward: one all-reduce per row-parallel linear (2 per layer), one per
sharded norm (OLMo 2: 2 more per layer), one per MoE block (the experts' weighted sum, in place
of the MLP's down projection), one all-reduce for the embedding and one gather of the logits
onto rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker_service.layers.moe import MoEExperts
from worker_service.models import family
from worker_service.models.interface import TP
from worker_service.parallel.geometry import ShardGeometry


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: the input features are split over ranks.

    The bias (replicated) is added once, after the reduction.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # [n, out] partial sum of this rank's input slice
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the table; other ids give zeros, summed over ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [n]
        outside = (local < 0) | (local >= self.num_embeddings)  # [n] ids another rank holds
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [n, hidden]
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(x)  # exactly one rank contributes a non-zero row per id
        return x


class GatheredLMHead(nn.Linear):
    """Logits of this rank's vocabulary slice, gathered on rank 0 in vocabulary order.

    Rank 0 gets `[rows, vocab]`; the other ranks get an empty `[rows, 0]` (they never sample).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, size: int):
        super().__init__(in_features, out_features, bias=False)
        self.rank, self.size = rank, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()  # [rows, vocab / k]
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.gather(local, parts, dst=0)
            return torch.cat(parts, dim=1)  # [rows, vocab]
        dist.gather(local, None, dst=0)
        return local[:, :0]


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split over the ranks (OLMo 2's q/k norm over all heads): each rank
    holds its columns and their slice of the weight; the sum of squares is all-reduced.

    Dividing the reduced sum by k * the local width is the mean over the whole width, also when
    KV heads are replicated (k > KV heads: each head is counted k / KV heads times). The
    rounding follows the module it replaces (`scale_in_float32`, see layers/norm.py RMSNorm).
    """

    def __init__(self, dim: int, eps: float, scale_in_float32: bool, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim / k] of the whole width
        self.eps, self.scale_in_float32, self.size = eps, scale_in_float32, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # [n, dim / k]
        squares = xf.square().sum(-1, keepdim=True)  # [n, 1] this rank's share
        dist.all_reduce(squares)
        normed = xf * torch.rsqrt(squares / (self.size * x.shape[-1]) + self.eps)
        if self.scale_in_float32:
            return (self.weight * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class RowParallelExperts(MoEExperts):
    """Stacked experts holding 1/k of every expert's intermediate width (gate_up rows, down
    columns) or, with expert parallelism, 1/k of the experts whole: each rank's weighted sum of
    its share (partial down projections, or its experts' outputs), all-reduced once."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        y = super().forward(x, weights, experts)  # [n, hidden] partial sum of this rank's slices
        dist.all_reduce(y)
        return y


def shard_modules(model: nn.Module, geom: ShardGeometry) -> None:
    """Swap the layers that communicate into `model` (built from `geom.local_config`, on meta), as
    its family declares: each `TP.ROW` weight's module, each `TP.COLUMN_NORM` norm, the embedding
    and the head."""
    fam = family(model.config.model_type)
    params = fam.params(model.config)
    for name in dict.fromkeys(p.module for p in params if p.tp is TP.ROW):
        old = model.get_submodule(name)  # weight: [out, in / k] of this rank's shard
        _replace(model, name, RowParallelLinear(old.in_features, old.out_features, bias=old.bias is not None))
    for name in dict.fromkeys(p.module for p in params if p.tp is TP.COLUMN_NORM):
        old = model.get_submodule(name)  # weight: [dim / k]
        _replace(model, name, ShardedRMSNorm(old.weight.shape[0], old.eps, old.scale_in_float32, geom.size))
    for name in dict.fromkeys(p.module for p in params if p.tp is TP.EXPERT):
        old = model.get_submodule(name)  # gate_up_proj: [2E, I/k, hidden], down_proj: [E, hidden, I/k] (EP: E/k, I)
        _replace(model, name, RowParallelExperts(old.num_experts, old.hidden, old.intermediate, old.first, old.total))
    emb = model.get_submodule(fam.embedding)  # weight: [vocab / k, hidden]
    _replace(model, fam.embedding, VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, geom.vocab_start))
    head = model.get_submodule(fam.lm_head)  # weight: [vocab / k, hidden]
    _replace(model, fam.lm_head, GatheredLMHead(head.in_features, head.out_features, geom.rank, geom.size))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
