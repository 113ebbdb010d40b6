"""GPT-2 decoder (`model_type` "gpt2"): LayerNorm, learned absolute positions, a GELU MLP,
biases everywhere, tied head; the shared layers with GPT-2's own projections. Module names
mirror Hugging Face's `GPT2LMHeadModel`; its `Conv1D` projections are `nn.Linear` here
(`[out, in]`), filled from the checkpoint's `[in, out]` transposed, as the declarations
(`gpt2_spec.py`) say.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_service.layers.activation import ACTIVATIONS
from worker_service.layers.attention import ForwardContext, layer_key, paged_attention
from worker_service.layers.mlp import MLP
from worker_service.layers.norm import LayerNorm
from worker_service.model_config import ModelConfig
from worker_service.models.gpt2_spec import GPT2, GPT2Family


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer = layer_key(layer_idx)  # [] int64, on the host
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5  # scale_attn_weights (the only setting accepted)
        # c_attn.weight: [q_size + 2 * kv_size, hidden] (q | k | v); c_proj.weight: [hidden, q_size]
        self.c_attn = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.c_proj = nn.Linear(self.q_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # x: [num_tokens, hidden]; no rope: positions are in the embedding
        n = x.shape[0]
        q, k, v = self.c_attn(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)  # [n, q] [n, kv] [n, kv]
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, ctx, self.layer, self.scale)  # [n, heads, d]
        return self.c_proj(out.reshape(n, self.q_size))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight, bias: [hidden]
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act])

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # [vocab, hidden]
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # [n_positions, hidden]
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(ctx.meta.positions)  # [n, hidden]: each token at its position
        for block in self.h:
            x = block(x, ctx)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    family: GPT2Family = GPT2

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # [vocab, hidden]
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`."""
        return self.transformer(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[rows, vocab]` float32 for the selected rows `[rows, hidden]`."""
        return self.lm_head(hidden).float()
