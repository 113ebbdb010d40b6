"""The model interface: what an architecture family declares for the rest of the worker.

Torch-free (the sim worker reads it). A family is a `ModelFamily` object, registered by
`model_type` in `worker_service.models`; its torch modules live in their own module, named
by `ModelFamily.module` and imported only when a model is built. From one declaration,
`params(cfg)` (every parameter of the built model, with the checkpoint tensors that fill it
and its tensor-parallel split), the rest follows:

- the loader (`worker_service/loader.py`) maps each checkpoint tensor onto its parameter
  (`Param.sources`, packed along `Param.pack_dim`, transposed where `Source.transpose`), refuses
  an unknown, missing or misshapen tensor, and ties the head to the embedding
  (`ModelFamily.embedding` / `lm_head`);
- tensor parallelism (`worker_service/parallel/`) divides the family's `axes` over the ranks
  (`ShardAxis`), reads each rank's slice of a checkpoint tensor (`Source.axis/dim/unit`), and
  swaps in the modules that communicate (`TP.ROW` weights: an all-reduce after; `TP.COLUMN_NORM`
  norms: an all-reduce of the sum of squares; the vocab-parallel embedding and the head
  gathered on rank 0);
- the sim cost model (`worker_service/sim/cost.py`) reads `counts(cfg)`: parameter counts by
  role and the attention / KV geometry.

`BaseModelConfig` holds the config.json fields a family reads; `worker_service.model_config.
ModelConfig` (the same fields, read from a checkpoint) is what families are given. A family
whose config.json names them otherwise maps its names (`ModelFamily.common_config`); one
without rotary positions says so (`ModelFamily.rope`), and the runner gives it no cos/sin.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

# Checkpoint tensors some checkpoints carry that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings as config.json's rope_scaling / rope_parameters give them;
    `worker_service/layers/rotary.py` computes the frequencies (`model_config.SUPPORTED_ROPE_TYPES`)."""

    theta: float
    rope_type: str = "default"  # a key of layers/rotary.py INV_FREQ: default, linear, dynamic, yarn, longrope, llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # the length trained at (llama3, yarn, longrope); dynamic: config.json's max_position_embeddings,
    # the length past which HF's dynamic NTK grows the base
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0  # the fraction of each head rotated (Phi-4-mini 0.75); the rest passes
    attention_factor: float | None = None  # yarn, longrope: cos/sin scale; None: derived from factor as HF does
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek): with mscale_all_dim, derives attention_factor
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: floor/ceil the correction range
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors below original_max_position_embeddings
    long_factor: tuple[float, ...] = ()  # longrope: at and past it

    def rotary_dim(self, head_dim: int) -> int:
        """The leading dims of each head that are rotated (HF: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)

    def max_positions(self, max_position_embeddings: int) -> int:
        """The positions a model can be served at: dynamic NTK scales its base to reach factor times
        the trained length (as vLLM serves it); every other type: max_position_embeddings."""
        if self.rope_type == "dynamic":
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings


class LayerType(Enum):
    """A layer's attention (config.json's `layer_types`, HF's names)."""

    FULL = "full_attention"  # every earlier key
    SLIDING = "sliding_attention"  # the last `sliding_window` keys (the query's own included)


@dataclass(frozen=True)
class BaseModelConfig:
    """The settings of a model, as config.json gives them (see `ModelConfig.from_dict`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"  # the MLP's activation (config.json's hidden_act, GPT-2's activation_function)
    # Mixture of experts (`ModelFamily.config_fields`; 0 experts: a dense model)
    num_experts: int = 0  # routed experts per MoE layer
    num_experts_per_tok: int = 0  # top-k: the experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's intermediate width
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to one
    decoder_sparse_step: int = 1  # layer i has experts when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (Qwen3-MoE): else a dense MLP
    # the experts this model's MoE layers hold: all of them, or under expert parallelism this rank's
    # contiguous share [first_local_expert, first_local_expert + num_local_experts) (`ShardAxis.offset_field`)
    num_local_experts: int = 0
    first_local_expert: int = 0
    # Attention per layer: config.json's layer_types; (): every layer SLIDING when sliding_window, else FULL
    layer_types: tuple[LayerType, ...] = ()
    # Gemma (`ModelFamily.config_fields`)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim's
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # the sliding layers' rope base (Gemma 3); None: `rope`'s

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to every earlier key)."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] is LayerType.FULL):
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer applies (None: some layer attends to every earlier key): the
        keys further back than it are read by no layer, so their KV blocks can be freed."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return None if None in windows else min(windows)

    def check(self) -> None:
        """Dimensions a model can be built with: a zero or negative one fails deep in torch,
        or (hidden_size 0) only after every layer has been built."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{HF_NAMES.get(name, name)} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_key_value_heads ({self.num_kv_heads}) must divide num_attention_heads "
                             f"({self.num_heads})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")


HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}


class TP(Enum):
    """How a parameter is split over k tensor-parallel ranks, and what its module does."""

    REPLICATED = "replicated"  # every rank holds all of it (norms, a row-parallel linear's bias)
    COLUMN = "column"  # output features split (dim 0): the module is unchanged, no communication
    ROW = "row"  # input features split (dim 1): the module all-reduces its output (RowParallelLinear)
    VOCAB = "vocab"  # vocabulary rows split: the embedding (masked lookup, all-reduce) or the head (gathered)
    # an RMSNorm over a column-split width (OLMo 2's q/k norm over all heads): its weight split like
    # those columns, the module all-reduces the sum of squares (ShardedRMSNorm)
    COLUMN_NORM = "column_norm"
    # a stacked expert weight ([experts, ...]): every expert's intermediate width split (each rank
    # holds 1/k of every expert, as vLLM's fused-MoE TP does) or, with expert parallelism, whole
    # experts split over the ranks; either way the experts module all-reduces the weighted sum of
    # its down projections once (RowParallelExperts)
    EXPERT = "expert"


class Kind(Enum):
    """What a parameter costs per step (sim cost model)."""

    LINEAR = "linear"  # a matmul weight applied to every token: 2 FLOPs per element per token
    EMBEDDING = "embedding"  # the input embedding: a row lookup (also the head when tied)
    LM_HEAD = "lm_head"  # the output projection, applied to the sampled rows only
    OTHER = "other"  # norms, biases: read every step, FLOPs negligible
    # a routed expert's weight: applied to the tokens routed to it (top-k of num_experts), read
    # only when a token of the step is routed to it
    EXPERT = "expert"


@dataclass(frozen=True)
class ShardAxis:
    """A dimension of the model that tensor parallelism divides over the ranks.

    `size(cfg)` is `cfg.<config_field>`; a rank's shard is built from the config with that field
    divided by k. The axis named "vocab" is the one the embedding and the head split along.
    """

    name: str  # how `Source.axis` refers to it, e.g. "heads"
    config_field: str  # the ModelConfig field holding its size, e.g. "num_heads"
    hf_name: str  # its name in config.json, for errors, e.g. "num_attention_heads"
    replicate: bool = False  # k > size: each rank holds one unit, shared by k/size ranks (KV heads)
    # divided only with expert parallelism (True: whole experts over the ranks) or only without it
    # (False: every expert's intermediate width); None: divided either way
    expert_parallel: bool | None = None
    offset_field: str | None = None  # a ModelConfig field a shard's config sets to its first unit


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor that fills a parameter, or a part of it along `Param.pack_dim`.

    Consecutive sources of one parameter with the same name are the parts of one fused
    checkpoint tensor, in order along its `dim` (= `Param.pack_dim`): Phi-3's `qkv_proj` is
    q | k | v, each part split along its own axis under TP (`Param.tensors` merges them).
    """

    name: str  # its name in the checkpoint, e.g. "model.layers.0.self_attn.k_proj.weight"
    size: int  # its extent along the parameter's pack_dim in this model (the rank's share under TP)
    axis: str | None = None  # the ShardAxis it splits along under TP; None: every rank reads all of it
    dim: int = 0  # the tensor dim the axis runs along
    unit: int = 1  # elements along `dim` per axis unit (head_dim for a heads axis)
    stack: bool = False  # it is one index (size 1) of pack_dim, without that dim (stacked experts)
    # the checkpoint holds the 2-D parameter transposed, [in, out] (GPT-2's Conv1D): the loader
    # copies its transpose; `dim` counts in the checkpoint tensor, as the TP slicing reads it
    transpose: bool = False

    def param_dim(self) -> int:
        """The parameter's dim that `dim` of the checkpoint tensor becomes."""
        return 1 - self.dim if self.transpose else self.dim


@dataclass(frozen=True)
class Param:
    """One parameter of the built model (`model.named_parameters()`; a tied head appears once)."""

    name: str  # e.g. "model.layers.0.self_attn.qkv_proj.weight"
    shape: tuple[int, ...]  # in this model (the rank's shard under TP)
    sources: tuple[Source, ...]  # the checkpoint tensors filling it, in order along pack_dim
    tp: TP = TP.REPLICATED
    kind: Kind = Kind.OTHER
    pack_dim: int = 0  # the dim its sources are concatenated along

    @property
    def module(self) -> str:
        """The name of the module holding it, e.g. "model.layers.0.self_attn.qkv_proj"."""
        return self.name.rpartition(".")[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def tensors(self) -> list[tuple[int, Source]]:
        """(offset along pack_dim, source) per checkpoint tensor: the parts of a fused tensor
        (consecutive sources of one name) merged into one source of their total size."""
        out: list[tuple[int, Source]] = []
        offset = 0
        for s in self.sources:
            if out and out[-1][1].name == s.name:
                start, first = out[-1]
                out[-1] = (start, dataclasses.replace(first, size=first.size + s.size))
            else:
                out.append((offset, s))
            offset += s.size
        return out


def param(name: str, shape: tuple[int, ...], *, axis: str | None = None, dim: int = 0, unit: int = 1,
          tp: TP = TP.REPLICATED, kind: Kind = Kind.OTHER, source: str | None = None) -> Param:
    """A parameter filled whole by one checkpoint tensor (named `source`, or like the parameter)."""
    return Param(name, shape, (Source(source or name, shape[0], axis, dim, unit),), tp, kind)


@dataclass(frozen=True)
class ModelCounts:
    """What the sim cost model needs of a model: parameter counts by role, attention and KV."""

    num_layers: int
    num_heads: int  # query heads: attention costs 4 * layers * heads * head_dim FLOPs per query-key pair
    num_kv_heads: int  # the KV cache holds 2 * layers * kv_heads * head_dim values per token
    head_dim: int
    linear_params: int  # matmul weights applied to every token, all layers together
    lm_head_params: int  # the head's weight (applied to sampled rows; the embedding's when tied)
    lookup_params: int  # read by row lookup only: an untied input embedding (not read whole per step)
    num_parameters: int  # every parameter, a tied one once
    expert_params: int = 0  # routed experts' weights, all layers (Kind.EXPERT; not in linear_params)
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # top-k: each token runs expert_params * experts_per_token / num_experts


class ModelFamily:
    """The declarations of one architecture family. A family file subclasses this (usually a
    frozen dataclass holding the flags its members differ by) and fills the members below."""

    model_type: str  # config.json's model_type
    module: str  # "package.module:Class": the torch model, built as `Class(cfg)`
    embedding: str = "model.embed_tokens"  # module path of the input embedding
    # the decoder's module under the head (HF's base_model_prefix): a checkpoint saved from the
    # bare decoder (GPT-2 on the hub: "h.0.attn...", not "transformer.h.0.attn...") names its
    # tensors without it, and the loader adds it (`checkpoint_name`)
    base_model_prefix: str = "model"
    lm_head: str = "lm_head"  # module path of the output projection
    axes: tuple[ShardAxis, ...] = ()  # what TP divides, in the order divisibility is checked
    # positions by rotary embedding: the runner gathers cos/sin per token (`ForwardContext.cos/sin`);
    # False: the model embeds positions itself from `ctx.meta.positions` (GPT-2's learned wpe)
    rope: bool = True
    # HF's modeling rotates only the first int(head_dim * partial_rotary_factor) dims of each head
    # (Phi-3); False: a partial_rotary_factor < 1 is refused (HF ignores it or fails on it)
    partial_rotary: bool = False
    # config.json's sliding_window windows attention (`BaseModelConfig.layer_window`) as HF's
    # modeling does; False: HF ignores it (Llama, OLMo 2), so does this family
    windowed: bool = True

    def common_config(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """config.json under the field names `ModelConfig.from_dict` reads (Llama's: hidden_size,
        num_attention_heads, ...); a family whose config.json names them otherwise maps them here."""
        return dict(raw)

    def check_config(self, raw: Mapping[str, Any]) -> None:
        """Refuse config.json values this family cannot build (ValueError naming the field)."""

    def config_fields(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """The `BaseModelConfig` fields with defaults this family reads from config.json (MoE)."""
        return {}

    def params(self, cfg: BaseModelConfig) -> list[Param]:
        """Every parameter of the model built from `cfg`, with its sources and TP split."""
        raise NotImplementedError

    def tied(self, cfg: BaseModelConfig) -> bool:
        """Whether the head shares the embedding's weight (then no head parameter is declared)."""
        return cfg.tie_word_embeddings

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as the declarations spell it: a bare decoder's tensor
        (neither under `base_model_prefix` nor the head's) gets the prefix, as HF's loading does."""
        if name.startswith((f"{self.base_model_prefix}.", f"{self.lm_head}.")):
            return name
        return f"{self.base_model_prefix}.{name}"

    def ignores(self, name: str, cfg: BaseModelConfig) -> bool:
        """A checkpoint tensor the model does not load (recomputed, or a tied head's copy)."""
        return name.endswith(IGNORED_SUFFIXES) or (self.tied(cfg) and name == f"{self.lm_head}.weight")

    def counts(self, cfg: BaseModelConfig) -> ModelCounts:
        """The sim cost model's view, summed from the declared parameters: those of the model
        without layers plus num_layers times one layer's (a config of 10^6 layers is counted,
        and refused, without listing them). A family whose layers differ overrides this."""
        by_kind = self.numel_by_kind(cfg)
        embedding = by_kind[Kind.EMBEDDING]
        tied = self.tied(cfg)
        return ModelCounts(
            num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            linear_params=by_kind[Kind.LINEAR],
            lm_head_params=embedding if tied else by_kind[Kind.LM_HEAD],
            lookup_params=0 if tied else embedding,
            num_parameters=sum(by_kind.values()),
            expert_params=by_kind[Kind.EXPERT], num_experts=cfg.num_experts,
            experts_per_token=cfg.num_experts_per_tok)

    def numel_by_kind(self, cfg: BaseModelConfig) -> dict[Kind, int]:
        """Parameter elements by kind: the model without layers + num_layers times one layer's."""
        by_kind = dict.fromkeys(Kind, 0)
        for layers, times in ((0, 1 - cfg.num_layers), (1, cfg.num_layers)):
            for p in self.params(dataclasses.replace(cfg, num_layers=layers)):
                by_kind[p.kind] += times * p.numel
        return by_kind

    def model_class(self) -> type:
        """The torch model class (imports torch)."""
        module, _, name = self.module.partition(":")
        return getattr(importlib.import_module(module), name)
