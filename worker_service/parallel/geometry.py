"""How a model's tensors split over k tensor-parallel ranks (Megatron-style, as vLLM does).

| tensor (HF name)                 | shape              | split            |
|----------------------------------|--------------------|------------------|
| q_proj weight / bias             | [H*d, hidden] / [H*d] | dim 0, H/k heads  |
| k_proj, v_proj weight / bias     | [KVH*d, hidden]    | dim 0, KVH/k heads, or one replicated head when k > KVH |
| o_proj weight                    | [hidden, H*d]      | dim 1 (row-parallel: all-reduce after) |
| gate_proj, up_proj weight        | [I, hidden]        | dim 0, I/k        |
| down_proj weight                 | [hidden, I]        | dim 1 (row-parallel: all-reduce after) |
| embed_tokens, lm_head weight     | [V, hidden]        | dim 0, V/k rows   |
| norms, o_proj bias               | any                | replicated       |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from worker_service.model_config import ModelConfig


class GeometryError(ValueError):
    """The model does not split over this many ranks; the message names the dimension."""


@dataclass(frozen=True)
class ShardGeometry:
    rank: int
    size: int  # k, the tensor-parallel world size
    head_dim: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int  # first KV head (global index) this rank holds
    intermediate: int  # MLP intermediate columns on this rank
    vocab: int  # vocabulary rows on this rank

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> ShardGeometry:
        if size < 1 or not 0 <= rank < size:
            raise GeometryError(f"tensor-parallel rank {rank} outside [0, {size})")
        _divides("num_attention_heads", cfg.num_heads, size)
        _divides("intermediate_size", cfg.intermediate_size, size)
        _divides("vocab_size", cfg.vocab_size, size)
        if cfg.num_kv_heads >= size:
            _divides("num_key_value_heads", cfg.num_kv_heads, size)
            kv_heads, kv_start = cfg.num_kv_heads // size, rank * (cfg.num_kv_heads // size)
        else:  # more ranks than KV heads: each rank holds one head, replicated size/KVH times
            if size % cfg.num_kv_heads:
                raise GeometryError(f"tensor-parallel size {size} is larger than num_key_value_heads "
                                    f"{cfg.num_kv_heads} and not a multiple of it")
            kv_heads, kv_start = 1, rank // (size // cfg.num_kv_heads)
        return cls(rank, size, cfg.head_dim, cfg.num_heads // size, kv_heads, kv_start,
                   cfg.intermediate_size // size, cfg.vocab_size // size)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: the model classes build it unchanged."""
        return dataclasses.replace(cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate, vocab_size=self.vocab)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor `name` held here; None: the whole tensor."""
        d = self.head_dim
        if ".q_proj." in name:
            return 0, self.rank * self.num_heads * d, self.num_heads * d
        if ".k_proj." in name or ".v_proj." in name:
            return 0, self.kv_head_start * d, self.num_kv_heads * d
        if name.endswith(".o_proj.weight"):
            return 1, self.rank * self.num_heads * d, self.num_heads * d
        if ".gate_proj." in name or ".up_proj." in name:
            return 0, self.rank * self.intermediate, self.intermediate
        if name.endswith(".down_proj.weight"):
            return 1, self.rank * self.intermediate, self.intermediate
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.vocab_start, self.vocab
        return None


def _divides(what: str, value: int, size: int) -> None:
    if value % size:
        raise GeometryError(f"{what} ({value}) is not divisible by the tensor-parallel size {size}")
