"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm).

Module names mirror Hugging Face's `LlamaForCausalLM`, except that q/k/v are fused into
`qkv_proj` and gate/up into `gate_up_proj`; the family's declarations (`llama_spec.py`:
which checkpoint tensors fill which parameter, the TP splits, the counts) say how HF's
separate tensors map onto them. Each class's `family` holds the flags its members differ by.
Phi-3 (`phi3.py`) uses these modules unchanged; OLMo 2 (`olmo2.py`) brings its own decoder
layer (`decoder_layer`), final norm (`norm`) and q/k projection (`LlamaAttention.project`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.attention import AttentionBackend, AttentionMetadata
from worker_service.model_config import ModelConfig
from worker_service.models.llama_spec import LLAMA, MISTRAL, QWEN2, QWEN3, LlamaFamily
from worker_service.rope import apply_rotary


@dataclass
class ForwardContext:
    """Everything a layer needs besides its hidden states, built once per step."""

    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) [blocks, block_size, kvh, d]
    # None for a family without rope (`ModelFamily.rope`: GPT-2 embeds meta.positions itself)
    cos: torch.Tensor | None  # [num_tokens, 1, head_dim]
    sin: torch.Tensor | None  # [num_tokens, 1, head_dim], first half negated (RotaryTable.lookup)
    # the sliding layers' cos/sin where their rope differs (Gemma 3's rope_local_base_freq); else None
    local_cos: torch.Tensor | None = None  # [num_tokens, 1, head_dim]
    local_sin: torch.Tensor | None = None  # [num_tokens, 1, head_dim]


class RMSNorm(nn.Module):
    # HF Llama: normalise in float32, cast back, then scale by the weight; OLMo 2 (True): scale
    # the float32 values, then cast
    scale_in_float32 = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)  # same math, fewer ops
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.scale_in_float32:
            return (self.weight * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: LlamaFamily):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.layer_window(layer_idx)  # None: every earlier key
        # qkv_proj.weight: [q_size + 2 * kv_size, hidden]; o_proj.weight: [hidden, q_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=family.has_qkv_bias(cfg))
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=family.has_o_bias(cfg))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if family.qk_norm else None  # weight: [d]
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if family.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # x: [num_tokens, hidden]
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qk, v = self.project(x)
        q, k = apply_rotary(qk, ctx.cos, ctx.sin).split((heads, kv_heads), dim=1)  # one rotation for q and k
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.meta)
        out = ctx.backend.attend(q, k_cache, v_cache, ctx.meta, self.scale, self.window)  # [n, heads, d]
        return self.o_proj(out.reshape(n, self.q_size))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k `[n, H + KVH, d]` (q/k-normed, before rope) and v `[n, KVH, d]`."""
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)  # [n, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(n, heads + kv_heads, self.head_dim)  # [n, H+KVH, d]
        v = qkv[:, self.q_size + self.kv_size :].view(n, kv_heads, self.head_dim)  # [n, kvh, d]
        if self.q_norm is not None:  # Qwen3: per head
            q, k = qk.split((heads, kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        return qk, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # [2 * inter, hidden]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)  # [hidden, inter]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [n, inter] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, family: LlamaFamily):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, family)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, family: LlamaFamily, decoder_layer: type[nn.Module] = LlamaDecoderLayer,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(cfg, i, family) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [n, hidden]
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    family: LlamaFamily = LLAMA
    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # built as decoder_layer(cfg, layer_idx, family)
    norm: type[RMSNorm] = RMSNorm  # the final norm's class
    base_model: type[LlamaModel] = LlamaModel  # built as base_model(cfg, family, decoder_layer, norm)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.base_model(cfg, self.family, self.decoder_layer, self.norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
