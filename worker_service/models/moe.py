"""Mixture-of-Experts decoders (Qwen3-MoE, Mixtral): `llama.py`'s decoder whose MLP is a sparse
MoE block (router + stacked experts); declarations and the checkpoint mapping in `moe_spec.py`.

The experts run batched per expert: the (token, expert) pairs are sorted by expert, and each
expert that has tokens runs one gate_up matmul and one down matmul over its rows; the rows'
weighted outputs go back to (token, slot) order and each token's k rows are summed. The loop
is over experts (E iterations at most), never over tokens. The rows per expert are read to
the host once per layer (a synchronisation; a fused grouped-GEMM kernel would avoid it on a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.model_config import ModelConfig
from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm
from worker_service.models.moe_spec import MIXTRAL, QWEN3_MOE, MoeFamily, is_sparse


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
    """Router + experts: softmax over E (float32), the top-k, renormalised as the family does."""

    def __init__(self, cfg: ModelConfig, family: MoeFamily):
        super().__init__()
        self.top_k, self.renormalize, self.cast_weights = cfg.num_experts_per_tok, cfg.norm_topk_prob, \
            family.cast_weights
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router weight: [E, hidden]
        self.experts = MoEExperts(cfg.num_local_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                  cfg.first_local_expert, cfg.num_experts)  # all E, unless EP shares them out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, k] each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.cast_weights:  # Qwen3-MoE: weights in the model dtype; Mixtral: float32 products
            weights = weights.to(x.dtype)
        return self.experts(x, weights, experts)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (pre-norms, residuals: its forward) with the MoE block as `mlp` where the
    config puts experts, else the dense Llama MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, family: MoeFamily):
        nn.Module.__init__(self)
        self.self_attn = LlamaAttention(cfg, layer_idx, family)
        self.mlp = SparseMoeBlock(cfg, family) if is_sparse(cfg, layer_idx) else LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    family = QWEN3_MOE
    decoder_layer = MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    family = MIXTRAL
    decoder_layer = MoeDecoderLayer
