"""Gemma 2 and Gemma 3 (text) decoders (`model_type` "gemma2", "gemma3_text"): the shared layers
with Gemma's options, on `llama.py`'s skeleton. Module names mirror HF's `Gemma2ForCausalLM` /
`Gemma3ForCausalLM` (q/k/v fused into qkv_proj, gate/up into gate_up_proj, as in llama.py); the
declarations, and what differs from Llama, are in `gemma_spec.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_service.layers.attention import ForwardContext
from worker_service.layers.norm import OffsetRMSNorm
from worker_service.model_config import ModelConfig
from worker_service.models.gemma_spec import GEMMA2, GEMMA3_TEXT, GemmaFamily
from worker_service.models.interface import LayerType
from worker_service.models.llama import LlamaForCausalLM, LlamaModel, llama_attention, llama_mlp


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: GemmaFamily):
        super().__init__()
        sliding = bool(cfg.layer_types) and cfg.layer_types[layer_idx] is LayerType.SLIDING
        self.self_attn = llama_attention(
            cfg, layer_idx, family, scale=cfg.query_pre_attn_scalar**-0.5,
            softcap=cfg.attn_logit_softcapping,  # None: none (Gemma 3)
            qk_norm=(lambda dim: OffsetRMSNorm(dim, cfg.rms_norm_eps)) if family.qk_norm else None,  # Gemma 3
            local_rope=sliding)  # Gemma 3's sliding layers: rope_local_base_freq
        self.mlp = llama_mlp(cfg)  # GeGLU: hidden_act gelu_pytorch_tanh
        for name in family.layer_norms:  # each weight: [hidden]
            setattr(self, name, OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # x: [num_tokens, hidden]; each sublayer normed before and after
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [n, hidden]
        # HF: the embedding times sqrt(hidden), the factor rounded to the model dtype first
        x = x * torch.tensor(x.shape[-1] ** 0.5, dtype=x.dtype, device=x.device)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    family: GemmaFamily = GEMMA2
    decoder_layer = GemmaDecoderLayer
    norm = OffsetRMSNorm
    base_model = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[rows, vocab]` float32, soft-capped in the model dtype (as HF) when configured."""
        logits = self.lm_head(hidden)  # [rows, vocab]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    family = GEMMA3_TEXT
