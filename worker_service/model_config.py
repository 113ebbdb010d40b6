"""The model settings the worker needs, read from a local Hugging Face checkpoint directory.

Reads `config.json` (and `generation_config.json` for EOS ids when present). Handles both the
transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x one (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from stepahead.config import ConfigError
from worker_service.models import FAMILIES
from worker_service.models.interface import BaseModelConfig, LayerType, RopeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3-128k's name before transformers 4.40


# The architectures the worker builds: the registry's (torch-free), so that a checkpoint is
# refused before torch is imported.
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
__all__ = ["SUPPORTED_MODEL_TYPES", "CheckpointError", "ModelConfig", "RopeConfig"]


class CheckpointError(ConfigError):
    """A checkpoint the worker cannot load, refused before any weight is read; names the file
    (and the field) so that the operator knows what to fix."""


class ModelConfig(BaseModelConfig):
    """`BaseModelConfig` (the fields, `models/interface.py`) read from a checkpoint directory."""

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(config_path.read_text())
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            return cls.from_dict(raw, _read_generation_eos(model_dir))
        except KeyError as exc:
            raise CheckpointError(f"{config_path}: field {exc.args[0]} is missing") from None
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise CheckpointError(f"{config_path}: {exc}") from None

    def num_parameters(self) -> int:
        """Parameters the model will have, from its dimensions alone (its family's declaration):
        what loading it will allocate, known before it is allocated."""
        return FAMILIES[self.model_type].counts(self).num_parameters

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_eos: tuple[int, ...] | None = None) -> ModelConfig:
        if "model_type" not in raw:
            raise ValueError("config.json has no model_type")
        if raw["model_type"] not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {raw['model_type']!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        raw = FAMILIES[raw["model_type"]].common_config(raw)  # e.g. GPT-2's n_embd -> hidden_size
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        if heads < 1:
            raise ValueError(f"num_attention_heads must be >= 1, got {heads}")
        if not raw.get("head_dim") and hidden % heads:
            raise ValueError(f"num_attention_heads ({heads}) must divide hidden_size ({hidden}) without head_dim")
        head_dim = raw.get("head_dim") or hidden // heads
        FAMILIES[raw["model_type"]].check_config(raw)
        num_layers = int(raw["num_hidden_layers"])
        config = cls(
            model_type=str(raw["model_type"]),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw, int(head_dim), FAMILIES[raw["model_type"]].partial_rotary),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            sliding_window=_sliding_window(raw) if FAMILIES[raw["model_type"]].windowed else None,
            layer_types=_layer_types(raw, num_layers),
            eos_token_ids=generation_eos if generation_eos is not None else _as_ids(raw.get("eos_token_id")),
            hidden_act=str(raw.get("hidden_act", "silu")),
            **FAMILIES[raw["model_type"]].config_fields(raw),
        )
        config.check()
        return config


def host_memory_bytes() -> int:
    """Memory the host can still give this process: MemAvailable, and no more than its cgroup's
    headroom (`memory.max` less `memory.current`, cgroup v2: a container's limit), else the
    machine's total."""
    available = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: the page count below
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's cgroup (v2) may still allocate, None without a limit."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((root / "memory.current").read_text()), 0)
    except (OSError, ValueError):
        return None


def check_fits(model_dir: str | Path, cfg: ModelConfig, bytes_per_param: int, memory_bytes: int, where: str) -> None:
    """Refuse a checkpoint whose weights alone exceed the memory they would be loaded into."""
    need = cfg.num_parameters() * bytes_per_param
    if need > memory_bytes:
        raise CheckpointError(
            f"{Path(model_dir) / 'config.json'}: the model's dimensions (num_hidden_layers {cfg.num_layers}, "
            f"hidden_size {cfg.hidden_size}, vocab_size {cfg.vocab_size}) make {cfg.num_parameters():,} parameters, "
            f"{need / 2**30:.1f} GiB of weights; {where} has {memory_bytes / 2**30:.1f} GiB")


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_generation_eos(model_dir: Path) -> tuple[int, ...] | None:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if raw.get("eos_token_id") is None:
        return None
    return _as_ids(raw["eos_token_id"])


def _sliding_window(raw: dict[str, Any]) -> int | None:
    if raw.get("use_sliding_window") is False:
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _layer_types(raw: dict[str, Any], num_layers: int) -> tuple[LayerType, ...]:
    given = raw.get("layer_types")
    if given is None:
        return ()
    if not isinstance(given, list) or len(given) != num_layers:
        raise ValueError(f"layer_types must list one type per layer (num_hidden_layers {num_layers}), got {given!r}")
    supported = [t.value for t in LayerType]
    for i, t in enumerate(given):
        if t not in supported:
            raise ValueError(f"unsupported layer_types[{i}] {t!r}; supported: {supported}")
    return tuple(LayerType(t) for t in given)


def _parse_rope(raw: dict[str, Any], head_dim: int, partial_ok: bool = False) -> RopeConfig:
    """config.json's rope settings; `partial_ok`: the family's HF modeling rotates part of each
    head when partial_rotary_factor < 1 (else it is refused: HF ignores it or fails on it)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    given = raw.get("rope_parameters") or {}
    field = "rope_parameters" if "rope_type" in given or "type" in given else "rope_scaling"
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} in {field}; supported: {SUPPORTED_ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if not _is_number(partial) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    if partial != 1.0 and not partial_ok:  # HF Llama & co. ignore it (default rope) or fail on it
        raise ValueError(f"unsupported partial_rotary_factor {partial} (rope over part of each head) for "
                         f"model_type {raw.get('model_type')!r}; only 1.0")
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} rotates {rotary_dim} of head_dim {head_dim}: "
                         f"must be an even number >= 2")
    max_pos = int(raw.get("max_position_embeddings", 2048))
    rope = RopeConfig(theta=theta, rope_type=rope_type, partial_rotary_factor=float(partial))
    if rope_type == "default":
        return rope
    if rope_type in ("linear", "dynamic"):
        factor = _rope_number(params, "factor", field)
        if rope_type == "dynamic" and factor < 1:
            raise ValueError(f"{field}.factor must be >= 1 for dynamic rope, got {factor}")
        # HF's dynamic NTK grows the base past config.json's max_position_embeddings
        return dataclasses.replace(rope, factor=factor, original_max_position_embeddings=max_pos)
    # llama3, yarn, longrope: the trained length; HF prefers a top-level one (Phi-3 saves it there)
    trained = raw.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))
    if isinstance(trained, bool) or not isinstance(trained, int) or trained < 1:
        raise ValueError(f"original_max_position_embeddings must be an integer >= 1, got {trained!r}")
    rope = dataclasses.replace(rope, original_max_position_embeddings=trained)
    if rope_type == "llama3":
        return dataclasses.replace(
            rope, factor=_rope_number(params, "factor", field),
            low_freq_factor=_rope_number(params, "low_freq_factor", field, positive=False),
            high_freq_factor=_rope_number(params, "high_freq_factor", field, positive=False))
    # yarn, longrope: a factor left out (null) is max_position_embeddings / the trained length
    factor = params.get("factor")
    factor = max_pos / trained if factor is None else _rope_number(params, "factor", field)
    attention = params.get("attention_factor")
    attention = None if attention is None else _rope_number(params, "attention_factor", field)
    rope = dataclasses.replace(rope, factor=factor, attention_factor=attention)
    if rope_type == "yarn":
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{field}.truncate must be true or false, got {truncate!r}")
        optional = {name: None if params.get(name) is None else _rope_number(params, name, field)
                    for name in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow")}
        return dataclasses.replace(
            rope, beta_fast=optional["beta_fast"] or 32.0, beta_slow=optional["beta_slow"] or 1.0,
            mscale=optional["mscale"], mscale_all_dim=optional["mscale_all_dim"], truncate=truncate)
    factors = {}
    for name in ("short_factor", "long_factor"):  # longrope
        value = params.get(name)
        if value is None:
            raise ValueError(f"{field}.{name} is missing (longrope needs short_factor and long_factor)")
        if not isinstance(value, list) or not all(_is_number(v) and v > 0 for v in value):
            raise ValueError(f"{field}.{name} must be a list of positive numbers, got {value!r}")
        if len(value) != rotary_dim // 2:
            raise ValueError(f"{field}.{name} has {len(value)} entries; the rotated {rotary_dim} dims of each "
                             f"head need {rotary_dim // 2}")
        factors[name] = tuple(float(v) for v in value)
    return dataclasses.replace(rope, **factors)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rope_number(params: dict[str, Any], name: str, field: str, positive: bool = True) -> float:
    """`params[name]` as a float; missing, not a number, or (`positive`) not > 0: an error naming it."""
    if name not in params or params[name] is None:
        raise ValueError(f"{field}.{name} is missing (rope type {params.get('rope_type', params.get('type'))!r})")
    value = params[name]
    if not _is_number(value) or (positive and not value > 0):
        raise ValueError(f"{field}.{name} must be a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def resolve_max_model_len(cfg, requested: int | None) -> int:
    """--max-model-len checked against the model's positions; default: all of them (a sliding
    window limits what a layer attends to, not the context)."""
    limit = cfg.rope.max_positions(cfg.max_position_embeddings)
    if requested is None:
        return limit
    if not 0 < requested <= limit:
        raise ValueError(f"max_model_len {requested} outside (0, {limit}] for this model")
    return requested
