"""The Phi-3 family's declarations (Phi-3, Phi-4; `model_type` "phi3"): torch-free.

Phi-3 is the Llama decoder (RMSNorm, SwiGLU, rope, no biases) whose checkpoint already holds
q/k/v fused into `qkv_proj` and gate/up into `gate_up_proj`, under the names our modules use:
the same parameters as `llama_spec.LlamaFamily` (see its table), each filled by one checkpoint
tensor in parts (`Source`: consecutive sources of one name), every part split along its own
axis under tensor parallelism:

| parameter (ours = HF)          | parts along dim 0        | TP split                                  |
|--------------------------------|--------------------------|-------------------------------------------|
| self_attn.qkv_proj weight      | q [H*d], k, v [KVH*d]    | column: H/k heads, KVH/k KV heads each    |
| mlp.gate_up_proj weight        | gate [I], up [I]         | column: I/k of each                       |

The modules are `llama.py`'s (`phi3.py` names the class). Rope: plain (`rope_type` default,
`partial_rotary_factor` 1); longrope / su scaling (Phi-3-128k, Phi-4-mini) is refused by
`model_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from worker_service.models.interface import BaseModelConfig, Param
from worker_service.models.llama_spec import LlamaFamily

FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")  # one checkpoint tensor each


@dataclass(frozen=True)
class Phi3Family(LlamaFamily):
    def has_qkv_bias(self, cfg: BaseModelConfig) -> bool:
        return False  # Phi3Attention: no biases, whatever config.json says of attention_bias

    def has_o_bias(self, cfg: BaseModelConfig) -> bool:
        return False

    def params(self, cfg: BaseModelConfig) -> list[Param]:
        return [fused(p) if p.name.endswith(FUSED) else p for p in super().params(cfg)]


def fused(p: Param) -> Param:
    """`p` with its sources renamed to the parameter's own name: the parts of one fused tensor."""
    return dataclasses.replace(p, sources=tuple(dataclasses.replace(s, name=p.name) for s in p.sources))


PHI3 = Phi3Family("phi3", "worker_service.models.phi3:Phi3ForCausalLM")
