"""OLMo 2 decoder (`model_type` "olmo2"): `llama.py`'s modules with the norms after the
sublayers and q/k RMSNorm over the whole projection width. Module names mirror HF's
`Olmo2ForCausalLM` (q/k/v fused into qkv_proj, gate/up into gate_up_proj, as in llama.py);
the declarations are in `olmo2_spec.py`."""

from __future__ import annotations

import torch
from torch import nn

from worker_service.model_config import ModelConfig
from worker_service.models.llama import ForwardContext, LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from worker_service.models.olmo2_spec import OLMO2, Olmo2Family


class Olmo2RMSNorm(RMSNorm):
    scale_in_float32 = True  # HF Olmo2RMSNorm: (weight * normed).to(dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: Olmo2Family):
        super().__init__(cfg, layer_idx, family)
        self.q_norm = Olmo2RMSNorm(self.q_size, cfg.rms_norm_eps)  # weight: [H * d], all heads at once
        self.k_norm = Olmo2RMSNorm(self.kv_size, cfg.rms_norm_eps)  # weight: [KVH * d]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k `[n, H + KVH, d]` (normed over the whole width, before rope) and v `[n, KVH, d]`."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)  # [n, q] [n, kv] [n, kv]
        qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-1).view(n, self.num_heads + self.num_kv_heads,
                                                                      self.head_dim)
        return qk, v.view(n, self.num_kv_heads, self.head_dim)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: Olmo2Family):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_idx, family)
        self.mlp = LlamaMLP(cfg)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight: [hidden]
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # x: [num_tokens, hidden]; the norms apply to each sublayer's output, not its input
        x = x + self.post_attention_layernorm(self.self_attn(x, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    family: Olmo2Family = OLMO2
    decoder_layer = Olmo2DecoderLayer
    norm = Olmo2RMSNorm
