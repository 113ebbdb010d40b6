"""Gemma 2 and Gemma 3 (text) decoders (`model_type` "gemma2", "gemma3_text"): `llama.py`'s
modules with Gemma's math. Module names mirror HF's `Gemma2ForCausalLM` / `Gemma3ForCausalLM`
(q/k/v fused into qkv_proj, gate/up into gate_up_proj, as in llama.py); the declarations, and
what differs from Llama, are in `gemma_spec.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.model_config import ModelConfig
from worker_service.models.gemma_spec import GEMMA2, GEMMA3_TEXT, GemmaFamily
from worker_service.models.interface import LayerType
from worker_service.models.llama import ForwardContext, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, RMSNorm
from worker_service.rope import apply_rotary


class GemmaRMSNorm(RMSNorm):
    """HF's Gemma RMSNorm: normalise and scale by `1 + weight`, both in float32, then cast."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)  # weight: [dim]; zero is the identity scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: GemmaFamily):
        super().__init__(cfg, layer_idx, family)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping  # None: none (Gemma 3)
        self.sliding = bool(cfg.layer_types) and cfg.layer_types[layer_idx] is LayerType.SLIDING
        if family.qk_norm:  # Gemma 3: per head, weight [d]
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # x: [num_tokens, hidden]
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qk, v = self.project(x)  # [n, H + KVH, d], [n, KVH, d]
        cos, sin = ctx.cos, ctx.sin
        if self.sliding and ctx.local_cos is not None:  # Gemma 3's sliding layers: rope_local_base_freq
            cos, sin = ctx.local_cos, ctx.local_sin
        q, k = apply_rotary(qk, cos, sin).split((heads, kv_heads), dim=1)  # [n, H, d], [n, KVH, d]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.meta)
        out = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale, self.window, self.softcap)  # [n, H, d]
        return self.o_proj(out.reshape(n, self.q_size))


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [n, inter] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)  # gelu_pytorch_tanh


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: GemmaFamily):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer_idx, family)
        self.mlp = GemmaMLP(cfg)
        for name in family.layer_norms:  # each weight: [hidden]
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

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
    norm = GemmaRMSNorm
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
