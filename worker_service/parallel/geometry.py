"""How a model's tensors split over k tensor-parallel ranks (Megatron-style, as vLLM does).

The model's family declares what divides (`ModelFamily.axes`: for the Llama family query
heads, KV heads, the MLP's intermediate columns and the vocabulary) and, for every checkpoint
tensor, the axis and dim it splits along (`Source.axis`, `Source.dim`); see the table in
`worker_service/models/llama_spec.py`. A rank holds the contiguous `size/k` units of each
axis at `rank * size/k`; an axis that may replicate (KV heads) gives each rank one unit when
k exceeds its size, shared by k/size neighbouring ranks. A tensor without an axis is read whole;
a fused one (several sources of one name, Phi-3's qkv_proj) as the concatenation of the rank's
slice of each of its parts. With expert parallelism the MoE families divide their experts
instead of the experts' width: a rank reads its experts' tensors whole and skips the others'
(`elsewhere`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from worker_service.model_config import ModelConfig
from worker_service.models import family
from worker_service.models.interface import Param


class GeometryError(ValueError):
    """The model does not split over this many ranks; the message names the dimension."""


@dataclass(frozen=True)
class ShardGeometry:
    rank: int
    size: int  # k, the tensor-parallel world size
    parts: dict[str, tuple[int, int]]  # axis -> (first unit, number of units) held by this rank
    # checkpoint tensor -> its parts (one unless fused), each (axis or None, dim, elements per unit,
    # start along dim in the whole tensor, length there); absent: read whole
    splits: dict[str, tuple[tuple[str | None, int, int, int, int], ...]] = field(
        default_factory=dict, repr=False, compare=False)
    # checkpoint tensors other ranks hold whole and this one does not read (other ranks' experts)
    elsewhere: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> ShardGeometry:
        """`expert_parallel`: the experts themselves are divided over the ranks (whole), instead of
        every expert's intermediate width (`ShardAxis.expert_parallel`)."""
        if size < 1 or not 0 <= rank < size:
            raise GeometryError(f"tensor-parallel rank {rank} outside [0, {size})")
        fam = family(cfg.model_type)
        if expert_parallel and not any(axis.expert_parallel for axis in fam.axes):
            raise GeometryError(f"--enable-expert-parallel: model_type {cfg.model_type!r} has no experts")
        parts = {}
        for axis in fam.axes:
            total = getattr(cfg, axis.config_field)
            if axis.expert_parallel not in (None, expert_parallel):  # not divided in this mode
                parts[axis.name] = (0, total)
            elif axis.replicate and total < size:  # more ranks than units: each holds one, replicated size/total times
                if size % total:
                    raise GeometryError(f"tensor-parallel size {size} is larger than {axis.hf_name} "
                                        f"{total} and not a multiple of it")
                parts[axis.name] = (rank // (size // total), 1)
            else:
                _divides(axis.hf_name, total, size)
                parts[axis.name] = (rank * (total // size), total // size)
        geom = cls(rank, size, parts, _splits(fam.params(cfg)))
        whole = {s.name for p in fam.params(cfg) for s in p.sources}
        held = {s.name for p in fam.params(geom.local_config(cfg)) for s in p.sources}
        return dataclasses.replace(geom, elsewhere=frozenset(whole - held))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: the model classes build it unchanged."""
        fam = family(cfg.model_type)
        sizes = {a.config_field: self.parts[a.name][1] for a in fam.axes}
        offsets = {a.offset_field: self.parts[a.name][0] for a in fam.axes if a.offset_field}
        return dataclasses.replace(cfg, **sizes, **offsets)

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

    def slice_of(self, name: str) -> list[tuple[int, int, int]] | None:
        """The (dim, start, length) cuts of checkpoint tensor `name` held here, concatenated along
        dim (one cut unless the tensor is fused); None: the whole tensor."""
        if name not in self.splits:
            return None
        cuts = []
        for axis, dim, unit, part_start, part_len in self.splits[name]:
            if axis is None:  # a part every rank reads whole
                cuts.append((dim, part_start, part_len))
            else:
                start, count = self.parts[axis]
                cuts.append((dim, part_start + start * unit, count * unit))
        return cuts


def _splits(params: list[Param]) -> dict[str, tuple[tuple[str | None, int, int, int, int], ...]]:
    """The split of each checkpoint tensor that has an axis, from the whole model's declaration."""
    splits: dict[str, list[tuple[str | None, int, int, int, int]]] = {}
    for p in params:
        start, prev = 0, None
        for s in p.sources:
            if s.name != prev:  # a new tensor (else the next part of a fused one)
                start, prev = 0, s.name
            splits.setdefault(s.name, []).append((s.axis, s.dim, s.unit, start, s.size))
            start += s.size
    return {name: tuple(parts) for name, parts in splits.items() if any(axis for axis, *_ in parts)}


def _divides(what: str, value: int, size: int) -> None:
    if value % size:
        raise GeometryError(f"{what} ({value}) is not divisible by the tensor-parallel size {size}")
