"""The Mixture-of-Experts families' declarations (Qwen3-MoE `qwen3_moe`, Mixtral `mixtral`):
torch-free. The modules are in `moe.py`.

The Llama decoder (`llama_spec.py`'s attention: Qwen3-MoE with q/k RMSNorm over head_dim,
Mixtral without) whose MLP is a sparse MoE block: a router `gate` [E, hidden] picks the top-k
of E experts per token by softmax probability, each a SwiGLU MLP of width I
(`moe_intermediate_size`; Mixtral: `intermediate_size`), and the token's output is the sum of
its experts' outputs weighted by those probabilities (renormalised to sum to one: Mixtral
always, Qwen3-MoE when `norm_topk_prob`). The checkpoint holds one tensor per expert (as
`save_pretrained` writes them and the published checkpoints hold them); the module stacks them
per layer, each checkpoint tensor one index of the stack (`Source.stack`):

| parameter (ours)              | checkpoint tensors (Qwen3-MoE / Mixtral)                    | shape          | TP split |
|-------------------------------|-------------------------------------------------------------|----------------|----------|
| mlp.gate weight (router)      | mlp.gate / block_sparse_moe.gate                            | [E, hidden]    | replicated |
| mlp.experts.gate_up_proj      | experts.{e}.gate_proj, up_proj / experts.{e}.w1, w3 at 2e, 2e+1 | [2E, I, hidden] | expert: I/k rows of each (EP: E/k whole experts) |
| mlp.experts.down_proj         | experts.{e}.down_proj / experts.{e}.w2 at e                 | [E, hidden, I] | expert: I/k columns of each (EP: E/k whole experts), the block's output all-reduced |

Qwen3-MoE's layer i has experts when `(i + 1) % decoder_sparse_step == 0` and i is not in
`mlp_only_layers`; the others have the Llama MLP (`intermediate_size`, column/row split).
With expert parallelism (`--enable-expert-parallel`) rank r holds experts [r E/k, (r + 1) E/k)
whole (`num_local_experts`, `first_local_expert`) and the router over all E; each rank computes
its experts' share of every token, and the same one all-reduce per MoE block sums the shares.
Shared experts (Qwen2-MoE) are not implemented.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker_service.models.interface import TP, BaseModelConfig, Kind, Param, ShardAxis, Source, param
from worker_service.models.llama_spec import AXES, LlamaFamily



def moe_axes(experts_field: str) -> tuple[ShardAxis, ...]:
    """Llama's axes and the experts': without expert parallelism every expert's intermediate width
    divides; with it, the experts themselves (`experts_field`: config.json's name for their count)."""
    return (*AXES, ShardAxis("moe_intermediate", "moe_intermediate_size", "moe_intermediate_size",
                             expert_parallel=False),
            ShardAxis("experts", "num_local_experts", experts_field, expert_parallel=True,
                      offset_field="first_local_expert"))


def is_sparse(cfg: BaseModelConfig, layer: int) -> bool:
    """Whether decoder layer `layer` has experts (else a dense MLP), as HF's decoder layer decides."""
    return (cfg.num_experts > 0 and layer not in cfg.mlp_only_layers
            and (layer + 1) % cfg.decoder_sparse_step == 0)


@dataclass(frozen=True)
class MoeFamily(LlamaFamily):
    block: str = "mlp"  # the MoE block's name in the checkpoint (Mixtral: block_sparse_moe)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2
    experts_field: str = "num_experts"  # config.json's (Mixtral: num_local_experts)
    moe_width_field: str = "moe_intermediate_size"  # config.json's expert width (Mixtral: intermediate_size)
    renormalize: bool | None = None  # the top-k weights renormalised; None: config.json's norm_topk_prob
    dense_layers: bool = False  # config.json may give dense layers (Qwen3-MoE)
    cast_weights: bool = True  # routing weights cast to the model dtype before weighting (Qwen3-MoE)
    axes: tuple[ShardAxis, ...] = moe_axes("num_experts")

    def config_fields(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        experts = raw.get(self.experts_field, raw.get("num_local_experts", raw.get("num_experts")))
        if experts is None:
            raise KeyError(self.experts_field)
        fields = dict(num_experts=int(experts), num_local_experts=int(experts),
                      num_experts_per_tok=int(raw["num_experts_per_tok"]),
                      moe_intermediate_size=int(raw[self.moe_width_field]),
                      norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if self.renormalize is None
                      else self.renormalize)
        if fields["num_experts"] < 1:
            raise ValueError(f"{self.experts_field} must be >= 1, got {fields['num_experts']}")
        if not 1 <= fields["num_experts_per_tok"] <= fields["num_experts"]:
            raise ValueError(f"num_experts_per_tok ({fields['num_experts_per_tok']}) must be in "
                             f"[1, {self.experts_field} ({fields['num_experts']})]")
        if fields["moe_intermediate_size"] < 1:
            raise ValueError(f"{self.moe_width_field} must be >= 1, got {fields['moe_intermediate_size']}")
        if self.dense_layers:
            step = raw.get("decoder_sparse_step")
            step = 1 if step is None else int(step)
            if step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
            only = tuple(sorted({int(i) for i in raw.get("mlp_only_layers") or ()}))
            fields.update(decoder_sparse_step=step, mlp_only_layers=only)
        return fields

    def check_config(self, raw: Mapping[str, Any]) -> None:
        super().check_config(raw)
        for name in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
            if raw.get(name):
                raise ValueError(f"unsupported {name} {raw[name]!r} (shared experts are not implemented)")

    def mlp_params(self, cfg: BaseModelConfig, mlp: str) -> list[Param]:
        layer = int(mlp.split(".")[2])  # "model.layers.{i}.mlp"
        if not is_sparse(cfg, layer):
            return super().mlp_params(cfg, mlp)
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        local = range(cfg.first_local_expert, cfg.first_local_expert + cfg.num_local_experts)  # all, unless EP
        src = f"{mlp.rpartition('.')[0]}.{self.block}"
        gate, up, down = self.expert_names
        one = [f"{src}.experts.{{}}.{n}.weight" for n in (gate, up, down)]
        return [
            # the router: [E, hidden], applied to every token, replicated (all E experts, also under EP)
            param(f"{mlp}.gate.weight", (cfg.num_experts, hidden), kind=Kind.LINEAR, source=f"{src}.gate.weight"),
            # gate_up_proj: [2E_local, I, hidden], local expert j's gate [I, hidden] at 2j, its up at 2j + 1
            Param(f"{mlp}.experts.gate_up_proj", (2 * len(local), inter, hidden), tuple(
                Source(name.format(e), 1, "moe_intermediate", 0, stack=True)
                for e in local for name in one[:2]), TP.EXPERT, Kind.EXPERT),
            # down_proj: [E_local, hidden, I], local expert j's [hidden, I] at j (without EP, I split over ranks)
            Param(f"{mlp}.experts.down_proj", (len(local), hidden, inter), tuple(
                Source(one[2].format(e), 1, "moe_intermediate", 1, stack=True) for e in local),
                TP.EXPERT, Kind.EXPERT),
        ]

    def numel_by_kind(self, cfg: BaseModelConfig) -> dict[Kind, int]:
        """Without listing every layer: one sparse and one dense layer, times how many of each."""
        step = cfg.decoder_sparse_step
        sparse = cfg.num_layers // step - sum(1 for i in cfg.mlp_only_layers if i < cfg.num_layers and (i + 1) % step == 0)
        by_kind = dict.fromkeys(Kind, 0)
        one = dataclasses.replace(cfg, num_layers=1, decoder_sparse_step=1)
        for layer_cfg, times in ((dataclasses.replace(cfg, num_layers=0), 1 - cfg.num_layers),
                                 (dataclasses.replace(one, mlp_only_layers=()), sparse),
                                 (dataclasses.replace(one, mlp_only_layers=(0,)), cfg.num_layers - sparse)):
            for p in self.params(layer_cfg):
                by_kind[p.kind] += times * p.numel
        return by_kind


_MODULE = "worker_service.models.moe"
QWEN3_MOE = MoeFamily("qwen3_moe", f"{_MODULE}:Qwen3MoeForCausalLM", qk_norm=True, dense_layers=True)
MIXTRAL = MoeFamily("mixtral", f"{_MODULE}:MixtralForCausalLM", block="block_sparse_moe",
                    expert_names=("w1", "w3", "w2"), experts_field="num_local_experts",
                    moe_width_field="intermediate_size", renormalize=True, cast_weights=False,
                    axes=moe_axes("num_local_experts"))
