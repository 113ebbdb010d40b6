"""GPT-2 decoder (`model_type` "gpt2"): LayerNorm, learned absolute positions, a GELU MLP,
biases everywhere, tied head. Module names mirror Hugging Face's `GPT2LMHeadModel`; its
`Conv1D` projections are `nn.Linear` here (`[out, in]`), filled from the checkpoint's
`[in, out]` transposed, as the declarations (`gpt2_spec.py`) say.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.model_config import ModelConfig
from worker_service.models.gpt2_spec import GPT2, GPT2Family
from worker_service.models.llama import ForwardContext


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, op for op (GPT-2's `gelu_new`)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
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
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.meta)
        out = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale)  # [n, heads, d]
        return self.c_proj(out.reshape(n, self.q_size))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)  # weight: [inter, hidden]
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)  # weight: [hidden, inter]
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # [n, inter] -> [n, hidden]


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)  # weight, bias: [hidden]
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # [vocab, hidden]
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # [n_positions, hidden]
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

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
