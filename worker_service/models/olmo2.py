"""OLMo 2 decoder (`model_type` "olmo2"): the shared layers with the norms after the sublayers
and q/k RMSNorm over the whole projection width (both scaling in float32), on `llama.py`'s
skeleton. Module names mirror HF's `Olmo2ForCausalLM` (q/k/v fused into qkv_proj, gate/up into
gate_up_proj, as in llama.py); the declarations are in `olmo2_spec.py`."""

from __future__ import annotations

import functools

import torch
from torch import nn

from worker_service.layers.attention import ForwardContext
from worker_service.layers.norm import RMSNorm
from worker_service.model_config import ModelConfig
from worker_service.models.llama import LlamaForCausalLM, llama_attention, llama_mlp
from worker_service.models.olmo2_spec import OLMO2, Olmo2Family

Olmo2RMSNorm = functools.partial(RMSNorm, scale_in_float32=True)  # HF Olmo2RMSNorm: (weight * normed).to(dtype)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: Olmo2Family):
        super().__init__()
        # q_norm weight: [H * d], k_norm: [KVH * d], all heads at once
        self.self_attn = llama_attention(cfg, layer_idx, family, qk_norm_per_head=False,
                                         qk_norm=lambda dim: Olmo2RMSNorm(dim, cfg.rms_norm_eps))
        self.mlp = llama_mlp(cfg)
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
