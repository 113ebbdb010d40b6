"""The GPT-2 family's declarations (`model_type` "gpt2", HF `GPT2LMHeadModel`): torch-free.
The modules are in `gpt2.py`.

GPT-2 is not Llama-shaped: LayerNorm with a bias, learned absolute positions (`wpe`, added to
the token embedding by each token's position; no rope: `rope = False`), a GELU MLP without a
gate, biases on every projection, a tied head (unless `tie_word_embeddings` is false), and its
own config.json names (`n_embd`, `n_head`, `n_layer`, `n_positions`, `n_inner`,
`layer_norm_epsilon`, `activation_function`; `common_config` maps them). Its checkpoint stores
the projections as `Conv1D` weights, `[in, out]`: each is declared `Source.transpose` (the
loader copies the transpose into our `nn.Linear` `[out, in]`; under TP the slice is cut from
the checkpoint tensor along `Source.dim`, which counts in its `[in, out]` layout).

| parameter (ours = HF)   | checkpoint tensor           | shape (ours)      | TP split                                           |
|-------------------------|-----------------------------|-------------------|----------------------------------------------------|
| attn.c_attn weight      | c_attn [hidden, 3*hidden]   | [3*H*d, hidden]   | column: per part q, k, v, H/k heads each (checkpoint dim 1) |
| attn.c_attn bias        | c_attn [3*hidden]           | [3*H*d]           | column: the same parts                             |
| attn.c_proj weight      | c_proj [hidden, hidden]     | [hidden, H*d]     | row: H/k heads of its input (checkpoint dim 0); bias replicated |
| mlp.c_fc weight / bias  | c_fc [hidden, I] / [I]      | [I, hidden] / [I] | column: I/k                                        |
| mlp.c_proj weight       | c_proj [I, hidden]          | [hidden, I]       | row: I/k of its input; bias replicated             |
| wte (and lm_head)       | the same names              | [V, hidden]       | vocab: V/k rows                                    |
| wpe                     | the same name               | [n_positions, hidden] | replicated                                     |
| ln_1, ln_2, ln_f weight / bias | the same names       | [hidden]          | replicated                                         |

Refused (CheckpointError naming the field): `scale_attn_weights` false,
`scale_attn_by_inverse_layer_idx`, `reorder_and_upcast_attn`, `add_cross_attention`, an
`activation_function` outside `ACTIVATIONS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker_service.models.interface import TP, BaseModelConfig, Kind, ModelFamily, Param, ShardAxis, Source, param
from worker_service.models.llama_spec import AXES

# the activation_function values gpt2.py builds (layers/activation.py ACTIVATIONS), as transformers' ACT2FN computes them
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")
# config.json fields whose other values change the model: the value implemented (HF's default)
IMPLEMENTED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
               "reorder_and_upcast_attn": False, "add_cross_attention": False}


@dataclass(frozen=True)
class GPT2Family(ModelFamily):
    model_type: str = "gpt2"
    module: str = "worker_service.models.gpt2:GPT2LMHeadModel"
    embedding: str = "transformer.wte"
    base_model_prefix: str = "transformer"
    lm_head: str = "lm_head"
    axes: tuple[ShardAxis, ...] = AXES  # kv_heads = heads: GPT-2 has no GQA
    rope: bool = False  # transformer.wpe, looked up by position in the model

    def common_config(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        embd, heads = int(raw["n_embd"]), int(raw["n_head"])
        if heads < 1 or embd % heads:
            raise ValueError(f"n_head ({heads}) must be >= 1 and divide n_embd ({embd})")
        eps = float(raw.get("layer_norm_epsilon", 1e-5))
        if not eps > 0:
            raise ValueError(f"layer_norm_epsilon must be > 0, got {eps}")
        return {**raw,  # GPT2Config's names (its attribute_map) and defaults, as the common ones
                "hidden_size": embd, "num_attention_heads": heads, "num_hidden_layers": raw["n_layer"],
                "max_position_embeddings": raw.get("n_positions", 1024),
                "intermediate_size": raw.get("n_inner") or 4 * embd,
                "rms_norm_eps": eps,  # the LayerNorms' epsilon
                "hidden_act": raw.get("activation_function", "gelu_new"),
                "tie_word_embeddings": raw.get("tie_word_embeddings", True),
                "attention_bias": True,
                # Llama-family fields GPT2Config does not read: not taken from config.json
                "num_key_value_heads": None, "head_dim": None, "sliding_window": None,
                "rope_parameters": None, "rope_scaling": None, "partial_rotary_factor": 1.0}

    def check_config(self, raw: Mapping[str, Any]) -> None:
        for field, implemented in IMPLEMENTED.items():
            if field in raw and bool(raw[field]) != implemented:
                raise ValueError(f"unsupported {field} {raw[field]!r} (only {implemented} is implemented)")
        act = raw.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation_function {act!r}; supported: {ACTIVATIONS}")

    def ignores(self, name: str, cfg: BaseModelConfig) -> bool:
        # older checkpoints carry the causal-mask buffers attn.bias / attn.masked_bias
        return super().ignores(name, cfg) or name.endswith((".attn.bias", ".attn.masked_bias"))

    def params(self, cfg: BaseModelConfig) -> list[Param]:
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        out = [param("transformer.wte.weight", (vocab, hidden), axis="vocab", tp=TP.VOCAB, kind=Kind.EMBEDDING),
               param("transformer.wpe.weight", (cfg.max_position_embeddings, hidden))]  # a lookup, replicated
        for i in range(cfg.num_layers):
            block = f"transformer.h.{i}"
            out += layer_norm(f"{block}.ln_1", hidden)
            out += self.attention_params(cfg, f"{block}.attn")
            out += layer_norm(f"{block}.ln_2", hidden)
            out += self.mlp_params(cfg, f"{block}.mlp")
        out += layer_norm("transformer.ln_f", hidden)
        if not self.tied(cfg):
            out.append(param("lm_head.weight", (vocab, hidden), axis="vocab", tp=TP.VOCAB, kind=Kind.LM_HEAD))
        return out

    def attention_params(self, cfg: BaseModelConfig, attn: str) -> list[Param]:
        hidden, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d  # kv == q (no GQA); both H/k heads under TP
        weight, bias = f"{attn}.c_attn.weight", f"{attn}.c_attn.bias"
        return [
            # c_attn: [q + 2 * kv, hidden], q | k | v along dim 0; the checkpoint's [hidden, 3 * hidden]
            # holds them along its dim 1, each part cut per rank
            Param(weight, (q + 2 * kv, hidden), (
                Source(weight, q, "heads", 1, d, transpose=True),
                Source(weight, kv, "kv_heads", 1, d, transpose=True),
                Source(weight, kv, "kv_heads", 1, d, transpose=True),
            ), TP.COLUMN, Kind.LINEAR),
            Param(bias, (q + 2 * kv,), (Source(bias, q, "heads", 0, d), Source(bias, kv, "kv_heads", 0, d),
                                        Source(bias, kv, "kv_heads", 0, d)), TP.COLUMN),
            # c_proj: [hidden, q], its input (heads) split: the checkpoint's [q, hidden] along dim 0
            Param(f"{attn}.c_proj.weight", (hidden, q),
                  (Source(f"{attn}.c_proj.weight", hidden, "heads", 0, d, transpose=True),), TP.ROW, Kind.LINEAR),
            param(f"{attn}.c_proj.bias", (hidden,)),
        ]

    def mlp_params(self, cfg: BaseModelConfig, mlp: str) -> list[Param]:
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        return [
            # c_fc: [inter, hidden] (checkpoint [hidden, inter]), its output split
            Param(f"{mlp}.c_fc.weight", (inter, hidden),
                  (Source(f"{mlp}.c_fc.weight", inter, "intermediate", 1, transpose=True),), TP.COLUMN, Kind.LINEAR),
            param(f"{mlp}.c_fc.bias", (inter,), axis="intermediate", tp=TP.COLUMN),
            # c_proj: [hidden, inter] (checkpoint [inter, hidden]), its input split
            Param(f"{mlp}.c_proj.weight", (hidden, inter),
                  (Source(f"{mlp}.c_proj.weight", hidden, "intermediate", 0, transpose=True),), TP.ROW, Kind.LINEAR),
            param(f"{mlp}.c_proj.bias", (hidden,)),
        ]


def layer_norm(name: str, hidden: int) -> list[Param]:
    return [param(f"{name}.weight", (hidden,)), param(f"{name}.bias", (hidden,))]


GPT2 = GPT2Family()
