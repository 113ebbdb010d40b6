"""Load one tensor-parallel rank's shard of a local checkpoint: only its slices are read."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from torch import nn

from worker_service.loader import empty_weights, load_weights, tie_weights, weight_files
from worker_service.model_config import ModelConfig
from worker_service.models import family
from worker_service.parallel.geometry import ShardGeometry
from worker_service.parallel.layers import shard_modules


def load_shard(model_dir: str | Path, dtype: torch.dtype, device: torch.device, rank: int,
               size: int, expert_parallel: bool = False) -> tuple[nn.Module, ModelConfig]:
    """(the rank's model, the *global* config); `model.config` is the shard's config.

    Raises GeometryError (naming the dimension) when the model does not split k ways.
    """
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    geom = ShardGeometry.of(cfg, rank, size, expert_parallel)
    files = weight_files(model_dir)
    fam = family(cfg.model_type)
    with empty_weights(device):
        model = fam.model_class()(geom.local_config(cfg))
        shard_modules(model, geom)
    model = model.to(dtype)
    tie_weights(model, fam)
    load_weights(model, iter_slices(files, geom, fam.checkpoint_name))
    return model.eval(), cfg


def iter_slices(files: list[Path], geom: ShardGeometry,
                canonical: Callable[[str], str] = lambda name: name) -> Iterator[tuple[str, torch.Tensor]]:
    """(name as the declarations spell it (`canonical`), this rank's slice of the tensor), each
    read alone from the file."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for stored in f.keys():
                    name = canonical(stored)
                    if name in geom.elsewhere:  # another rank's expert: never read here
                        continue
                    cuts = geom.slice_of(name)
                    if cuts is None:
                        yield name, f.get_tensor(stored)
                        continue
                    whole = f.get_slice(stored)
                    # [..., start : start + length, ...] along dim, per part of a fused tensor
                    parts = [whole[(slice(None),) * dim + (slice(start, start + length),)] for dim, start, length in cuts]
                    yield name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=cuts[0][0])
        except SafetensorError as e:
            raise ValueError(f"weight file {path} is truncated or corrupt: {e}") from e
