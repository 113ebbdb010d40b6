"""The Gemma 2 and Gemma 3 (text) families' declarations (`model_type` "gemma2", "gemma3_text";
HF `Gemma2ForCausalLM`, `Gemma3ForCausalLM`): torch-free. The modules are in `gemma.py`.

The Llama decoder's parameters (`llama_spec.py`'s table: fused qkv_proj / gate_up_proj from HF's
separate tensors, the same TP splits; biases on q/k/v/o when `attention_bias`; Gemma 3's per-head
q/k norms `[d]`, replicated) plus two more norms per layer: input_layernorm,
post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm (`[hidden]`,
replicated). What differs is in the math (`gemma.py`): RMSNorm scales by `1 + weight` in float32,
the embedding is multiplied by sqrt(hidden) in the model dtype, the MLP is GeGLU (tanh GELU),
scores are scaled by `query_pre_attn_scalar ** -0.5`, layers alternate sliding-window and global
attention (`layer_types`, or every `sliding_window_pattern`-th layer global, as HF's configs
default it), Gemma 2 soft-caps attention scores, both may soft-cap the final logits, and Gemma 3's
sliding layers take their rope base from `rope_local_base_freq`. The head is tied unless
`tie_word_embeddings` is false.

Refused (naming the field): a `hidden_activation` other than gelu_pytorch_tanh,
`use_bidirectional_attention` (EmbeddingGemma), Gemma 3's `attn_logit_softcapping` (HF's
Gemma 3 does not apply it), a Gemma 3 sliding-layer rope other than the plain one; the global
layers' rope goes through the common rope parser (`model_config._parse_rope`), which refuses the
types it does not implement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker_service.models.interface import LayerType
from worker_service.models.llama_spec import LlamaFamily

ACTIVATIONS = ("gelu_pytorch_tanh",)  # hidden_activation values gemma.py builds (layers/activation.py ACTIVATIONS)


@dataclass(frozen=True)
class GemmaFamily(LlamaFamily):
    # HF's config class defaults, for the fields a config.json may leave out
    defaults: tuple[tuple[str, Any], ...] = ()
    sliding_window_pattern: int = 2  # every n-th layer global when config.json lists no layer_types
    attn_softcapping: bool = True  # the config's attn_logit_softcapping is applied (Gemma 2)
    layer_norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")

    def common_config(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        out = {**dict(self.defaults), **raw}
        out["hidden_act"] = out.get("hidden_activation", "gelu_pytorch_tanh")  # HF reads hidden_activation
        num_layers = int(out["num_hidden_layers"])
        if out.get("layer_types") is None:  # HF's default: sliding but every pattern-th layer
            pattern = int(out.get("sliding_window_pattern", self.sliding_window_pattern))
            if pattern < 1:
                raise ValueError(f"sliding_window_pattern must be >= 1, got {pattern}")
            out["layer_types"] = [(LayerType.FULL if (i + 1) % pattern == 0 else LayerType.SLIDING).value
                                  for i in range(num_layers)]
        rope = out.get("rope_parameters")
        if isinstance(rope, Mapping) and set(rope) & {t.value for t in LayerType}:  # per layer type (5.x)
            local = dict(rope.get(LayerType.SLIDING.value) or {})
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported rope_parameters.sliding_attention rope_type "
                                 f"{local['rope_type']!r}; only 'default'")
            if "rope_theta" in local:
                out["rope_local_base_freq"] = local["rope_theta"]
            out["rope_parameters"] = rope.get(LayerType.FULL.value) or {}
        return out

    def check_config(self, raw: Mapping[str, Any]) -> None:
        if raw["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_activation {raw['hidden_act']!r}; supported: {ACTIVATIONS}")
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"unsupported use_bidirectional_attention {raw['use_bidirectional_attention']!r} "
                             "(only causal attention)")
        if not self.attn_softcapping and raw.get("attn_logit_softcapping") is not None:
            raise ValueError(f"unsupported attn_logit_softcapping {raw['attn_logit_softcapping']!r} for "
                             f"{self.model_type} (Hugging Face does not apply it); only null")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_base_freq"):
            value = raw.get(name)
            if value is not None and not float(value) > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")

    def config_fields(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        def opt(name: str) -> float | None:
            return None if raw.get(name) is None else float(raw[name])

        return {"query_pre_attn_scalar": float(raw["query_pre_attn_scalar"]),
                "attn_logit_softcapping": opt("attn_logit_softcapping") if self.attn_softcapping else None,
                "final_logit_softcapping": opt("final_logit_softcapping"),
                "rope_local_theta": opt("rope_local_base_freq")}


_MODULE = "worker_service.models.gemma"
# Gemma2Config's defaults
GEMMA2 = GemmaFamily("gemma2", f"{_MODULE}:Gemma2ForCausalLM", defaults=(
    ("head_dim", 256), ("tie_word_embeddings", True), ("max_position_embeddings", 8192),
    ("rms_norm_eps", 1e-6), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
    ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)))
# Gemma3TextConfig's defaults (rope_theta: the global layers', rope_local_base_freq: the sliding ones')
GEMMA3_TEXT = GemmaFamily("gemma3_text", f"{_MODULE}:Gemma3ForCausalLM", qk_norm=True, sliding_window_pattern=6,
                          attn_softcapping=False, defaults=(
    ("head_dim", 256), ("tie_word_embeddings", True), ("max_position_embeddings", 131072),
    ("rms_norm_eps", 1e-6), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
    ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0)))
