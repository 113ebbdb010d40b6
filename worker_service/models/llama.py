"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm), composed
of the shared layers (`worker_service/layers/`).

Module names mirror Hugging Face's `LlamaForCausalLM`, except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj`; the family's declarations (`llama_spec.py`:
which checkpoint tensors fill which parameter, the TP splits, the counts) say how HF's
separate tensors map onto them. Each class's `family` holds the flags its members differ by.
The other decoder families reuse this skeleton (`LlamaForCausalLM` with their own
`decoder_layer`, `norm`, `base_model`): Phi-3, OLMo 2, Gemma, the MoE families.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker_service.layers.activation import ACTIVATIONS
from worker_service.layers.attention import Attention, ForwardContext
from worker_service.layers.mlp import GatedMLP
from worker_service.layers.norm import RMSNorm
from worker_service.model_config import ModelConfig
from worker_service.models.llama_spec import LLAMA, MISTRAL, QWEN2, QWEN3, LlamaFamily


def llama_attention(cfg: ModelConfig, layer_idx: int, family: LlamaFamily, **options) -> Attention:
    """The family's attention of layer `layer_idx` (`options`: `Attention`'s, overriding)."""
    options.setdefault("qk_norm", (lambda dim: RMSNorm(dim, cfg.rms_norm_eps)) if family.qk_norm else None)  # Qwen3
    return Attention(layer_idx, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     qkv_bias=family.has_qkv_bias(cfg), o_bias=family.has_o_bias(cfg),
                     window=cfg.layer_window(layer_idx), **options)


def llama_mlp(cfg: ModelConfig) -> GatedMLP:
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act])  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: LlamaFamily):
        super().__init__()
        self.self_attn = llama_attention(cfg, layer_idx, family)
        self.mlp = llama_mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight: [hidden]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # x: [num_tokens, hidden]; pre-norms, residuals
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(self.input_layernorm(x), ctx))
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, family: LlamaFamily, decoder_layer: type[nn.Module] = LlamaDecoderLayer,
                 norm: Callable[[int, float], nn.Module] = RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # [vocab, hidden]
        self.layers = nn.ModuleList(decoder_layer(cfg, i, family) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)  # weight: [hidden]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [n, hidden]
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    family: LlamaFamily = LLAMA
    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # built as decoder_layer(cfg, layer_idx, family)
    norm: Callable[[int, float], nn.Module] = RMSNorm  # the final norm, built as norm(hidden, eps)
    base_model: type[LlamaModel] = LlamaModel  # built as base_model(cfg, family, decoder_layer, norm)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.base_model(cfg, self.family, self.decoder_layer, type(self).norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # [vocab, hidden]
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[rows, vocab]` float32 for the selected rows `[rows, hidden]`."""
        return self.lm_head(hidden).float()


class MistralForCausalLM(LlamaForCausalLM):
    family = MISTRAL


class Qwen2ForCausalLM(LlamaForCausalLM):
    family = QWEN2


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = QWEN3
