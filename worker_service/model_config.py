"""The model settings the worker needs, read from a local Hugging Face checkpoint directory.

Reads `config.json` (and `generation_config.json` for EOS ids when present). Handles both the
transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x one (`rope_parameters`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepahead.config import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "llama3")


# The architectures the worker builds (worker_service.models registers one class for each),
# named here so that a checkpoint is refused before torch is imported.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class CheckpointError(ConfigError):
    """A checkpoint the worker cannot load, refused before any weight is read; names the file
    (and the field) so that the operator knows what to fix."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
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

    def check(self) -> None:
        """Dimensions a model can be built with: a zero or negative one fails deep in torch,
        or (hidden_size 0) only after every layer has been built."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_HF_NAMES.get(name, name)} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_key_value_heads ({self.num_kv_heads}) must divide num_attention_heads "
                             f"({self.num_heads})")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")

    def num_parameters(self) -> int:
        """Parameters the model will have, from its dimensions alone (embeddings, attention,
        MLP, norms): what loading it will allocate, known before it is allocated."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q + 2 * kv) + (q + 2 * kv if self.attention_bias else 0)
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_eos: tuple[int, ...] | None = None) -> ModelConfig:
        if "model_type" not in raw:
            raise ValueError("config.json has no model_type")
        if raw["model_type"] not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {raw['model_type']!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        if heads < 1:
            raise ValueError(f"num_attention_heads must be >= 1, got {heads}")
        if not raw.get("head_dim") and hidden % heads:
            raise ValueError(f"num_attention_heads ({heads}) must divide hidden_size ({hidden}) without head_dim")
        head_dim = raw.get("head_dim") or hidden // heads
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
        config = cls(
            model_type=str(raw["model_type"]),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            sliding_window=_sliding_window(raw),
            eos_token_ids=generation_eos if generation_eos is not None else _as_ids(raw.get("eos_token_id")),
        )
        config.check()
        return config


_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}


def host_memory_bytes() -> int:
    """Memory the host can still give this process (MemAvailable), else its total."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: the page count below
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def resolve_max_model_len(cfg, requested: int | None) -> int:
    """--max-model-len checked against the model's positions (and sliding window); default: all of them."""
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None:
        limit = min(limit, cfg.sliding_window)  # no sliding-window attention: stay within it
    if requested is None:
        return limit
    if not 0 < requested <= limit:
        raise ValueError(f"max_model_len {requested} outside (0, {limit}] for this model")
    return requested
