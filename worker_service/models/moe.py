"""Mixture-of-Experts decoders (Qwen3-MoE, Mixtral): `llama.py`'s decoder whose MLP is the shared
sparse MoE block (`worker_service/layers/moe.py`: router + stacked experts, run batched per
expert); declarations and the checkpoint mapping in `moe_spec.py`.
"""

from __future__ import annotations

from torch import nn

from worker_service.layers.moe import SparseMoeBlock
from worker_service.layers.norm import RMSNorm
from worker_service.model_config import ModelConfig
from worker_service.models.llama import LlamaDecoderLayer, LlamaForCausalLM, llama_attention, llama_mlp
from worker_service.models.moe_spec import MIXTRAL, QWEN3_MOE, MoeFamily, is_sparse


def sparse_moe(cfg: ModelConfig, family: MoeFamily) -> SparseMoeBlock:
    """The config's experts (all E, unless expert parallelism shares them out: `num_local_experts`
    from `first_local_expert`), renormalised and rounded as the family does."""
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                          renormalize=cfg.norm_topk_prob, cast_weights=family.cast_weights,
                          num_local=cfg.num_local_experts, first_local=cfg.first_local_expert)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (pre-norms, residuals: its forward) with the MoE block as `mlp` where the
    config puts experts, else the dense Llama MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, family: MoeFamily):
        nn.Module.__init__(self)
        self.self_attn = llama_attention(cfg, layer_idx, family)
        self.mlp = sparse_moe(cfg, family) if is_sparse(cfg, layer_idx) else llama_mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight: [hidden]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    family = QWEN3_MOE
    decoder_layer = MoeDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    family = MIXTRAL
    decoder_layer = MoeDecoderLayer
