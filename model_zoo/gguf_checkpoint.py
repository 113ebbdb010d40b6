"""A GGUF file as an ordinary Hugging Face checkpoint directory.

`convert(gguf_path, out_dir)` reads a GGUF (llama.cpp's format) with the `gguf` package,
dequantizes every tensor to the serving dtype, undoes llama.cpp's rotary permutation of the
query and key projections, and writes config.json, model.safetensors, generation_config.json
and the tokenizer files (with the chat template the GGUF carries). The worker then loads the
directory like any other checkpoint, and `AutoModelForCausalLM.from_pretrained(dir)` loads it
too. Quantized weights are not kept quantized: a Q4 file becomes float32 (or `dtype`) weights.

`check(gguf_path)` reads only the header and names the first thing this converter cannot
handle (architecture, tensor type), so `serve --model FILE.gguf` refuses a file before any
daemon starts. Conversion is deterministic: the same file gives the same bytes.

Module-level imports stay light (the CLI imports this module to check a path).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stepahead.config import ConfigError, NotBuiltYet

ORIGIN_FILE = "stepahead_origin.json"


class GGUFError(ConfigError):
    """A GGUF file this converter cannot turn into a checkpoint; the message names why."""


@dataclass(frozen=True)
class _Family:
    """How one GGUF `general.architecture` maps onto a Hugging Face model_type."""

    model_type: str
    hf_class: str  # config.json's `architectures`
    # llama.cpp's converter permutes q/k rows of these (Llama's rotary layout); others keep HF's
    permuted_qk: bool


# The architectures the worker serves (worker_service.model_config), by GGUF name.
FAMILIES: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": _Family("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": _Family("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
}

# GGUF per-layer tensor name -> Hugging Face name (format with the layer index).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Rotary frequency factors (Llama 3.1-style or LongRoPE scaling): refused, as this converter
# writes no rope_scaling and the model would run with plain rotary frequencies.
_ROPE_FACTORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def is_gguf(spec: str | os.PathLike) -> bool:
    return str(spec).lower().endswith(".gguf")


def _reader(path: Path):
    import gguf

    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:  # a bad magic, a truncated header
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# The tensor types converted (llama.cpp's common file types; gguf's numpy dequantizer
# implements each), by GGMLQuantizationType name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def _hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    raise GGUFError(f"tensor {gguf_name!r} has no Hugging Face counterpart in this converter")


def check(gguf_path: str | os.PathLike, *, need_tokenizer: bool = True) -> str:
    """Raise GGUFError naming the first unsupported part of the file; return its architecture."""
    path = Path(gguf_path).expanduser()
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(FAMILIES))})")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") or any(t.name in _ROPE_FACTORS for t in reader.tensors):
        raise GGUFError(f"{path}: rotary scaling ({scaling or 'frequency factors'}) is not supported by this "
                        "converter; convert the original Hugging Face checkpoint instead")
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {tensor.name} has quantization type {tensor.tensor_type.name}, "
                            "which this converter cannot dequantize")
        _hf_name(tensor.name)
    if need_tokenizer and _field(reader, "tokenizer.ggml.model") is None:
        raise GGUFError(f"{path}: the GGUF carries no tokenizer; pass --tokenizer DIR")
    return arch


def _config(reader, family: _Family, dtype: str) -> dict:
    """config.json for the family, from the GGUF's `<arch>.*` keys and its tensors."""
    arch = _field(reader, "general.architecture")
    names = {t.name: t for t in reader.tensors}
    vocab = int(names["token_embd.weight"].shape[-1])  # [hidden, vocab] fastest-first: the embedding's rows

    def key(name, default=None):
        return _field(reader, f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    config = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "dtype": dtype,
    }
    return {k: v for k, v in config.items() if v is not None}


def _tensors(reader, family: _Family, config: dict, dtype: str) -> dict:
    """Every weight as a torch tensor of `dtype`, named and laid out as Hugging Face's."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, dequantize

    out: dict[str, torch.Tensor] = {}
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims fastest-first
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.asarray(tensor.data, dtype=np.float32)
        else:
            array = dequantize(tensor.data, tensor.tensor_type)
        weights = torch.from_numpy(np.array(array.reshape(shape), dtype=np.float32))  # a writable copy
        if family.permuted_qk:
            for proj, n_head in heads.items():
                if f".{proj}." in name:
                    weights = _unpermute(weights, n_head)
        out[name] = weights.to(getattr(torch, dtype)).contiguous()
    return out


def _unpermute(weights, n_head: int):
    """Undo llama.cpp's q/k row permutation: GGUF interleaves the two rotary halves of each
    head (rows [heads, half, 2]); Hugging Face keeps them apart (rows [heads, 2, half])."""
    # weights: [n_head * head_dim, ...] (a weight matrix or a bias)
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, half, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


def _tokenizer(gguf_path: Path, tokenizer_dir: str | None):
    from transformers import AutoTokenizer

    if tokenizer_dir is not None:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _tidy_tokenizer_config(path: Path, context_length: int) -> None:
    """Drop the loader's bookkeeping keys and give the real context length."""
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    data["model_max_length"] = context_length
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
            tokenizer_dir: str | None = None, origin: dict | None = None) -> Path:
    """Write the checkpoint directory for `gguf_path` into `out_dir` (created; must be empty)."""
    import safetensors.torch
    from transformers import GenerationConfig

    path = Path(gguf_path).expanduser()
    check(path, need_tokenizer=tokenizer_dir is None)
    reader = _reader(path)
    family = FAMILIES[_field(reader, "general.architecture")]
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _tokenizer(path, tokenizer_dir)
    config = _config(reader, family, dtype)
    if len(tokenizer) > config["vocab_size"]:
        raise GGUFError(f"{path}: the tokenizer has {len(tokenizer)} tokens, the embedding {config['vocab_size']} rows")
    tensors = _tensors(reader, family, config, dtype)
    safetensors.torch.save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    eos = config.get("eos_token_id")
    GenerationConfig(bos_token_id=config.get("bos_token_id"), eos_token_id=eos,
                     pad_token_id=config.get("pad_token_id")).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _tidy_tokenizer_config(out / "tokenizer_config.json", config["max_position_embeddings"])
    record = {"source": path.name, "sha256": _sha256(path), "architecture": _field(reader, "general.architecture"),
              "name": _field(reader, "general.name"), "license": _field(reader, "general.license"),
              "dtype": dtype, **(origin or {})}
    (out / ORIGIN_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out


def cached_conversion(gguf_path: str | os.PathLike, models_dir: Path, *, dtype: str = "float32",
                      tokenizer_dir: str | None = None, build: bool = True) -> Path:
    """The converted directory for `gguf_path` under `models_dir`, converting it first if absent
    (with `build=False`, as the gateway asks, an absent conversion is an error).

    Keyed by the file's content and the dtype, so a changed file converts again; built in a
    temporary sibling and renamed into place, so a reader never sees half a checkpoint.
    """
    path = Path(gguf_path).expanduser().resolve()
    check(path, need_tokenizer=tokenizer_dir is None)
    stat = path.stat()
    key = hashlib.blake2b(f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}:{tokenizer_dir}".encode(),
                          digest_size=8).hexdigest()
    target = models_dir / f"gguf-{path.stem}-{key}"
    if target.is_dir():
        return target
    if not build:
        raise NotBuiltYet(f"{path} is not converted yet: start the worker (or `stepahead serve`) with it first")
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=models_dir))
    try:
        shutil.rmtree(staging)
        convert(path, staging, dtype=dtype, tokenizer_dir=tokenizer_dir)
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target
