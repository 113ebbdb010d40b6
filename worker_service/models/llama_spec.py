"""The Llama family's declarations (Llama, Mistral, Qwen2, Qwen3): torch-free, read by the
loader, tensor parallelism and the sim cost model. The modules are in `llama.py`.

| parameter (ours)               | checkpoint tensors (HF)  | shape                  | TP split                                  |
|--------------------------------|--------------------------|------------------------|-------------------------------------------|
| self_attn.qkv_proj weight/bias | q_proj, k_proj, v_proj   | [(H + 2*KVH)*d, hidden] | column: H/k heads, KVH/k KV heads (one replicated head when k > KVH) |
| self_attn.o_proj weight        | o_proj                   | [hidden, H*d]          | row (all-reduce after); its bias replicated |
| self_attn.q_norm, k_norm       | q_norm, k_norm (Qwen3)   | [d]                    | replicated                                |
| mlp.gate_up_proj weight        | gate_proj, up_proj       | [2*I, hidden]          | column: I/k                               |
| mlp.down_proj weight           | down_proj                | [hidden, I]            | row (all-reduce after)                    |
| embed_tokens, lm_head weight   | the same names           | [V, hidden]            | vocab: V/k rows                           |
| norms                          | the same names           | [hidden]               | replicated                                |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker_service.models.interface import TP, BaseModelConfig, Kind, ModelFamily, Param, ShardAxis, Source, param

AXES = (
    ShardAxis("heads", "num_heads", "num_attention_heads"),
    ShardAxis("intermediate", "intermediate_size", "intermediate_size"),
    ShardAxis("vocab", "vocab_size", "vocab_size"),
    ShardAxis("kv_heads", "num_kv_heads", "num_key_value_heads", replicate=True),
)


@dataclass(frozen=True)
class LlamaFamily(ModelFamily):
    model_type: str
    module: str  # the torch class in worker_service.models.llama
    qkv_bias: bool = False  # Qwen2: q/k/v always have a bias, o_proj never
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    axes: tuple[ShardAxis, ...] = AXES
    windowed: bool = True  # HF Llama ignores config.json's sliding_window; Mistral, Qwen2, Qwen3 apply it

    def check_config(self, raw: Mapping[str, Any]) -> None:
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")

    def has_qkv_bias(self, cfg: BaseModelConfig) -> bool:
        return cfg.attention_bias or self.qkv_bias

    def has_o_bias(self, cfg: BaseModelConfig) -> bool:
        return cfg.attention_bias and not self.qkv_bias

    # the layer's RMSNorms over hidden, besides the model's final `model.norm`
    layer_norms = ("input_layernorm", "post_attention_layernorm")

    def params(self, cfg: BaseModelConfig) -> list[Param]:
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        out = [param("model.embed_tokens.weight", (vocab, hidden), axis="vocab", tp=TP.VOCAB, kind=Kind.EMBEDDING)]
        for i in range(cfg.num_layers):
            out += self.attention_params(cfg, f"model.layers.{i}.self_attn")
            out += self.mlp_params(cfg, f"model.layers.{i}.mlp")
            out += [param(f"model.layers.{i}.{norm}.weight", (hidden,)) for norm in self.layer_norms]
        out.append(param("model.norm.weight", (hidden,)))
        if not self.tied(cfg):
            out.append(param("lm_head.weight", (vocab, hidden), axis="vocab", tp=TP.VOCAB, kind=Kind.LM_HEAD))
        return out

    def attention_params(self, cfg: BaseModelConfig, attn: str) -> list[Param]:
        hidden, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        out = []
        for suffix, tail in [("weight", (hidden,))] + ([("bias", ())] if self.has_qkv_bias(cfg) else []):
            # qkv_proj: [q + 2 * kv, hidden] (weight) / [q + 2 * kv] (bias), q | k | v along dim 0
            out.append(Param(f"{attn}.qkv_proj.{suffix}", (q + 2 * kv, *tail), (
                Source(f"{attn}.q_proj.{suffix}", q, "heads", 0, d),
                Source(f"{attn}.k_proj.{suffix}", kv, "kv_heads", 0, d),
                Source(f"{attn}.v_proj.{suffix}", kv, "kv_heads", 0, d),
            ), TP.COLUMN, Kind.LINEAR if suffix == "weight" else Kind.OTHER))
        # o_proj: [hidden, q], its input (heads) split over ranks
        out.append(param(f"{attn}.o_proj.weight", (hidden, q), axis="heads", dim=1, unit=d, tp=TP.ROW,
                         kind=Kind.LINEAR))
        if self.has_o_bias(cfg):
            out.append(param(f"{attn}.o_proj.bias", (hidden,)))
        return out + self.qk_norm_params(cfg, attn)

    def qk_norm_params(self, cfg: BaseModelConfig, attn: str) -> list[Param]:
        if not self.qk_norm:
            return []
        d = cfg.head_dim  # Qwen3: one [d] weight shared by every head
        return [param(f"{attn}.q_norm.weight", (d,)), param(f"{attn}.k_norm.weight", (d,))]

    def mlp_params(self, cfg: BaseModelConfig, mlp: str) -> list[Param]:
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        # gate_up_proj: [2 * inter, hidden], gate | up along dim 0
        return [Param(f"{mlp}.gate_up_proj.weight", (2 * inter, hidden), (
                    Source(f"{mlp}.gate_proj.weight", inter, "intermediate"),
                    Source(f"{mlp}.up_proj.weight", inter, "intermediate"),
                ), TP.COLUMN, Kind.LINEAR),
                # down_proj: [hidden, inter], its input split over ranks
                param(f"{mlp}.down_proj.weight", (hidden, inter), axis="intermediate", dim=1, tp=TP.ROW,
                      kind=Kind.LINEAR)]


_MODULE = "worker_service.models.llama"
LLAMA = LlamaFamily("llama", f"{_MODULE}:LlamaForCausalLM", windowed=False)
MISTRAL = LlamaFamily("mistral", f"{_MODULE}:MistralForCausalLM")
QWEN2 = LlamaFamily("qwen2", f"{_MODULE}:Qwen2ForCausalLM", qkv_bias=True)
QWEN3 = LlamaFamily("qwen3", f"{_MODULE}:Qwen3ForCausalLM", qk_norm=True)
