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
    """E SwiGLU experts stacked: gate_up_proj [2E, I, hidden] (expert e's gate rows at 2e, up at
    2e + 1), down_proj [E, hidden, I]. Under TP, I is this rank's share (RowParallelExperts)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(2 * num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [n, hidden]; weights, experts [n, k] (each token's top-k): Σ_j weights[:, j] * expert_j(x)."""
        n, k = experts.shape
        flat = experts.reshape(-1)  # [n * k] (token, slot) pairs, token-major
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # rows per expert (one host sync)
        tokens = order // k  # [n * k] the token of each sorted pair
        rows = x[tokens]  # [n * k, hidden]
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            seg = rows[start:start + count]  # [count, hidden]
            gate, up = F.linear(seg, self.gate_up_proj[2 * e:2 * e + 2].reshape(-1, self.hidden)).split(
                self.intermediate, dim=-1)  # [count, I] each
            out[start:start + count] = F.linear(F.silu(gate) * up, self.down_proj[e])  # [count, hidden]
            start += count
        weighted = (out * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)  # [n * k, hidden], sorted
        # back in (token, slot) order, each token's k rows summed (cheaper than index_add_ on CPU)
        return torch.empty_like(weighted).index_copy_(0, order, weighted).view(n, k, -1).sum(dim=1)  # [n, hidden]


class SparseMoeBlock(nn.Module):
    """Router + experts: softmax over E (float32), the top-k, renormalised as the family does."""

    def __init__(self, cfg: ModelConfig, family: MoeFamily):
        super().__init__()
        self.top_k, self.renormalize, self.cast_weights = cfg.num_experts_per_tok, cfg.norm_topk_prob, \
            family.cast_weights
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router weight: [E, hidden]
        self.experts = MoEExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

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
