"""The OLMo 2 family's declarations (`model_type` "olmo2"): torch-free. The modules are in `olmo2.py`.

OLMo 2 is the Llama decoder (see `llama_spec.py`'s table: fused qkv_proj / gate_up_proj from
HF's separate tensors, biases when `attention_bias`) with two differences:
- norms after the sublayers, not before: `x + post_attention_layernorm(attn(x))`, then
  `x + post_feedforward_layernorm(mlp(x))`; no input_layernorm;
- q/k RMSNorm over the whole projection width (all heads together), before rope:

| parameter (ours = HF)          | shape      | TP split                                                       |
|--------------------------------|------------|----------------------------------------------------------------|
| self_attn.q_norm weight        | [H*d]      | column norm: H/k heads' slice, sum of squares all-reduced        |
| self_attn.k_norm weight        | [KVH*d]    | column norm: KVH/k KV heads' slice (one replicated when k > KVH) |
| post_attention_layernorm, post_feedforward_layernorm | [hidden] | replicated                             |
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_service.models.interface import TP, BaseModelConfig, Param, param
from worker_service.models.llama_spec import LlamaFamily


@dataclass(frozen=True)
class Olmo2Family(LlamaFamily):
    layer_norms = ("post_attention_layernorm", "post_feedforward_layernorm")

    def qk_norm_params(self, cfg: BaseModelConfig, attn: str) -> list[Param]:
        d = cfg.head_dim
        return [param(f"{attn}.q_norm.weight", (cfg.num_heads * d,), axis="heads", unit=d, tp=TP.COLUMN_NORM),
                param(f"{attn}.k_norm.weight", (cfg.num_kv_heads * d,), axis="kv_heads", unit=d, tp=TP.COLUMN_NORM)]


OLMO2 = Olmo2Family("olmo2", "worker_service.models.olmo2:Olmo2ForCausalLM", windowed=False)  # as HF Olmo2
