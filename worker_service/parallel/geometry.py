"""How a model's tensors split over k tensor-parallel ranks (Megatron-style, as vLLM does).

The model's family declares what divides (`ModelFamily.axes`: for the Llama family query
heads, KV heads, the MLP's intermediate columns and the vocabulary) and, for every checkpoint
tensor, the axis and dim it splits along (`Source.axis`, `Source.dim`); see the table in
`worker_service/models/llama_spec.py`. A rank holds the contiguous `size/k` units of each
axis at `rank * size/k`; an axis that may replicate (KV heads) gives each rank one unit when
k exceeds its size, shared by k/size neighbouring ranks. A tensor without an axis is read whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from worker_service.model_config import ModelConfig
from worker_service.models import family


class GeometryError(ValueError):
    """The model does not split over this many ranks; the message names the dimension."""


@dataclass(frozen=True)
class ShardGeometry:
    rank: int
    size: int  # k, the tensor-parallel world size
    parts: dict[str, tuple[int, int]]  # axis -> (first unit, number of units) held by this rank
    # checkpoint tensor -> (axis, dim, elements per unit) of its split; absent: read whole
    splits: dict[str, tuple[str, int, int]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> ShardGeometry:
        if size < 1 or not 0 <= rank < size:
            raise GeometryError(f"tensor-parallel rank {rank} outside [0, {size})")
        fam = family(cfg.model_type)
        parts = {}
        for axis in fam.axes:
            total = getattr(cfg, axis.config_field)
            if axis.replicate and total < size:  # more ranks than units: each holds one, replicated size/total times
                if size % total:
                    raise GeometryError(f"tensor-parallel size {size} is larger than {axis.hf_name} "
                                        f"{total} and not a multiple of it")
                parts[axis.name] = (rank // (size // total), 1)
            else:
                _divides(axis.hf_name, total, size)
                parts[axis.name] = (rank * (total // size), total // size)
        splits = {s.name: (s.axis, s.dim, s.unit) for p in fam.params(cfg) for s in p.sources if s.axis is not None}
        return cls(rank, size, parts, splits)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: the model classes build it unchanged."""
        fam = family(cfg.model_type)
        return dataclasses.replace(cfg, **{a.config_field: self.parts[a.name][1] for a in fam.axes})

    def count(self, axis: str) -> int:
        """Units of `axis` on this rank."""
        return self.parts[axis][1]

    # The axes every decoder has, by name (the Llama family's).
    @property
    def num_heads(self) -> int:
        return self.count("heads")

    @property
    def num_kv_heads(self) -> int:
        return self.count("kv_heads")

    @property
    def kv_head_start(self) -> int:
        return self.parts["kv_heads"][0]

    @property
    def vocab(self) -> int:
        return self.count("vocab")

    @property
    def vocab_start(self) -> int:
        return self.parts["vocab"][0]

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor `name` held here; None: the whole tensor."""
        if name not in self.splits:
            return None
        axis, dim, unit = self.splits[name]
        start, count = self.parts[axis]
        return dim, start * unit, count * unit


def _divides(what: str, value: int, size: int) -> None:
    if value % size:
        raise GeometryError(f"{what} ({value}) is not divisible by the tensor-parallel size {size}")
