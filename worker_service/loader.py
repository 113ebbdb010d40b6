"""Load a local Hugging Face checkpoint (config.json + safetensors, sharded or not) by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from worker_service.model_config import ModelConfig
from worker_service.models import model_class
from worker_service.models.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def load_model(model_dir: str | Path, dtype: torch.dtype,
               device: torch.device) -> tuple[LlamaForCausalLM, ModelConfig]:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    cls = model_class(cfg.model_type)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, iter_tensors(files))
    return model.eval(), cfg


def load_weights(model: LlamaForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model; every parameter must be filled exactly once."""
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away here
    pending: dict[str, set[int]] = {name: set(range(_num_shards(model, name))) for name in params}
    tied = model.config.tie_word_embeddings
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, shard = _target(model, name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        _copy(model, params[target], target, shard, name, tensor)
        pending[target].discard(shard if shard is not None else 0)
    missing = sorted(name for name, shards in pending.items() if shards)
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {missing}")


def _num_shards(model: LlamaForCausalLM, param_name: str) -> int:
    for fused, _ in model.packed_modules.values():
        if f".{fused}." in param_name:
            return len(model.shard_sizes(fused))
    return 1


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, int | None]:
    for part, (fused, shard) in model.packed_modules.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _copy(model, param: torch.Tensor, target: str, shard: int | None, name: str, tensor: torch.Tensor) -> None:
    if shard is None:
        dst = param.data
    else:
        sizes = model.shard_sizes(target.split(".")[-2])
        dst = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)
