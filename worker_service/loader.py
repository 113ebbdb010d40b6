"""Load a local Hugging Face checkpoint (config.json + safetensors, sharded or not) by name."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from worker_service.model_config import ModelConfig
from worker_service.models import family
from worker_service.models.interface import ModelFamily, Param, Source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPES)}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked to exist."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"weight shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"weight file {path} is truncated or corrupt: {e}") from e


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, ModelConfig]:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    fam = family(cfg.model_type)
    files = weight_files(model_dir)
    with empty_weights(device):
        model = fam.model_class()(cfg)
    model = model.to(dtype)
    tie_weights(model, fam)
    load_weights(model, iter_tensors(files))
    return model.eval(), cfg


# torch.nn.init's in-place initializers, which the layers' constructors call
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def empty_weights(device: torch.device):
    """Modules built inside get their parameters allocated on `device` and not initialized:
    every one is filled from the checkpoint next (`load_weights` refuses a checkpoint that
    leaves one out). Not the meta device: its first use in a process imports the meta kernels
    and sympy, seconds of a worker's start-up (`benchmarks/startup.py`)."""
    saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device(device):
            yield
    finally:
        for name, initializer in saved.items():
            setattr(nn.init, name, initializer)


def tie_weights(model: nn.Module, fam: ModelFamily) -> None:
    """The head shares the embedding's weight (the model was built with a head of its own)."""
    if fam.tied(model.config):
        model.get_submodule(fam.lm_head).weight = model.get_submodule(fam.embedding).weight


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model as its family declares (`ModelFamily.params`);
    every parameter must be filled exactly once, each of its sources at least once."""
    cfg = model.config
    fam = family(cfg.model_type)
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away here
    declared = check_declaration(fam, model)
    targets: dict[str, tuple[Param, int, Source]] = {}  # checkpoint name -> (param, offset along pack_dim, source)
    for p in declared:
        for offset, source in p.tensors():  # a fused tensor's parts: one slot of their total size
            targets[source.name] = (p, offset, source)
    pending = {p.name: {s.name for s in p.sources} for p in declared}
    for stored, tensor in tensors:
        name = fam.checkpoint_name(stored)  # a bare decoder's checkpoint: its names under the prefix
        if fam.ignores(name, cfg):
            continue
        if name not in targets:
            raise ValueError(f"checkpoint tensor {stored!r} has no matching model parameter")
        p, offset, source = targets[name]
        copy_into(params[p.name], p.pack_dim, offset, source, name, tensor)
        pending[p.name].discard(name)
    missing = sorted(name for name, sources in pending.items() if sources)
    if missing:
        tensors = sorted(t for name in missing for t in pending[name])  # e.g. one expert's of a stacked weight
        shown = ", ".join(tensors[:8]) + (f", ... ({len(tensors)} in all)" if len(tensors) > 8 else "")
        raise ValueError(f"checkpoint lacks weights for: {missing} (tensors {shown})")


def check_declaration(fam: ModelFamily, model: nn.Module) -> list[Param]:
    """The family's declared parameters, checked against the built model's (names and shapes):
    a family that forgot a parameter fails here, before any weight is read."""
    declared = fam.params(model.config)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    listed = {p.name: p.shape for p in declared}
    if len(listed) != len(declared) or listed != built:
        wrong = sorted(n for n in built.keys() | listed.keys() if built.get(n) != listed.get(n))
        raise RuntimeError(f"model family {fam.model_type!r} declares parameters that differ from its modules': "
                           f"{[(n, listed.get(n), built.get(n)) for n in wrong[:5]]}")
    return declared


def copy_into(dst: torch.Tensor, pack_dim: int, offset: int, source: Source, name: str, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor `name` into `dst[..., offset : offset + size, ...]` along `pack_dim`
    (or into index `offset` of it, `source.stack`; transposed first, `source.transpose`)."""
    part = dst.data.narrow(pack_dim, offset, source.size)  # the source's slot: [..., size, ...]
    if source.stack:
        part = part.select(pack_dim, 0)  # one slice of a stacked parameter, e.g. expert `offset`: [...]
    if source.transpose:
        tensor = tensor.t()  # a Conv1D weight [in, out] -> [out, in]
    if tuple(part.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(part.shape)}")
    part.copy_(tensor)
