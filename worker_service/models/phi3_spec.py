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

The modules are `llama.py`'s (`phi3.py` names the class). Rope: `rope_type` default or longrope
(`su` its old name; Phi-3-128k, Phi-4-mini), over the first `partial_rotary_factor` of each head
(Phi-4-mini: 0.75), as Phi3Config accepts them; the other types are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker_service.models.interface import BaseModelConfig, Param
from worker_service.models.llama_spec import LlamaFamily

PHI3_ROPE_TYPES = ("default", "longrope", "su")
FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")  # one checkpoint tensor each


@dataclass(frozen=True)
class Phi3Family(LlamaFamily):
    partial_rotary = True  # Phi3's apply_rotary_pos_emb rotates the first rotary_dim dims (Phi-4-mini)

    def common_config(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        # Phi3Config's default trained length (longrope reads it from the top level, not rope_scaling)
        return {"original_max_position_embeddings": 4096, **raw}

    def check_config(self, raw: Mapping[str, Any]) -> None:
        super().check_config(raw)
        params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in PHI3_ROPE_TYPES:  # Phi3Config refuses the others (and reads yarn as longrope)
            raise ValueError(f"unsupported rope type {rope_type!r} for model_type 'phi3'; supported: "
                             f"{PHI3_ROPE_TYPES}")

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
