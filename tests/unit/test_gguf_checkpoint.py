"""GGUF → Hugging Face directory (`model_zoo.gguf_checkpoint`).

The oracle is the checkpoint the GGUF was written from: the built-in `tiny` is written as
llama.cpp's converter writes a Llama (q/k rows permuted for its rotary layout, GGUF tensor
names, dims fastest-first), converted back, and compared tensor by tensor and by HF greedy
output. The real smollm2-135m conversion is checked against transformers' own GGUF loader
by the real-model tests' oracle (same tokens) rather than here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model_zoo import gguf_checkpoint
from stepahead.config import NotBuiltYet
from model_zoo.gguf_checkpoint import GGUFError
from tests.fixtures_models import tiny_model_dir  # noqa: F401

_HF_TO_GGUF = {v: k for k, v in {**gguf_checkpoint._GLOBAL_TENSORS}.items()}
_LAYER = {v: k for k, v in gguf_checkpoint._LAYER_TENSORS.items()}


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of what we undo)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def write_gguf(model_dir: Path, path: Path, *, arch: str = "llama", quant: gguf.GGMLQuantizationType | None = None,
               tokenizer: bool = False, rope_scaling: bool = False) -> dict[str, torch.Tensor]:
    """`model_dir` (a Llama) as a GGUF file; 2-D weights in `quant` when given. Returns the
    state dict it was written from."""
    import json

    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    state = load_file(model_dir / "model.safetensors")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, tensor in sorted(state.items()):
        array = tensor.float().numpy()
        for proj, n_head in heads.items():
            if f".{proj}." in name:
                array = _permute(array, n_head)
        if quant is not None and array.ndim == 2:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    return path, write_gguf(tiny_model_dir, path)


def test_f32_round_trip_is_exact_and_generates_as_the_original(tiny_gguf, tiny_model_dir, tmp_path):  # noqa: F811
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path, state = tiny_gguf
    out = gguf_checkpoint.convert(path, tmp_path / "out", tokenizer_dir=str(tiny_model_dir))
    converted = load_file(out / "model.safetensors")
    assert converted.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(converted[name], tensor), name
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 17, 300, 41, 7]])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert loaded.generate(ids, **kw).tolist() == original.generate(ids, **kw).tolist()
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_conversion_is_deterministic(tiny_gguf, tiny_model_dir, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    digests = []
    for run in ("a", "b"):
        out = gguf_checkpoint.convert(path, tmp_path / run, tokenizer_dir=str(tiny_model_dir))
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())})
    assert digests[0] == digests[1]


@pytest.mark.parametrize("quant, tolerance", [(gguf.GGMLQuantizationType.Q8_0, 0.01),
                                               (gguf.GGMLQuantizationType.Q4_0, 0.2)])
def test_quantized_weights_are_dequantized_close_to_the_original(tiny_model_dir, tmp_path, quant, tolerance):  # noqa: F811
    from safetensors.torch import load_file

    state = write_gguf(tiny_model_dir, tmp_path / "q.gguf", quant=quant)
    out = gguf_checkpoint.convert(tmp_path / "q.gguf", tmp_path / "out", tokenizer_dir=str(tiny_model_dir))
    converted = load_file(out / "model.safetensors")
    for name, tensor in state.items():
        assert converted[name].dtype == torch.float32
        scale = tensor.abs().max().item()
        assert (converted[name] - tensor).abs().max().item() <= tolerance * scale, name


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):  # noqa: F811
    write_gguf(tiny_model_dir, tmp_path / "g.gguf", arch="gemma2", tokenizer=True)
    with pytest.raises(GGUFError, match=r"architecture 'gemma2' is not supported \(supported: llama, qwen2, qwen3\)"):
        gguf_checkpoint.check(tmp_path / "g.gguf")


def test_unsupported_tensor_type_is_named(tiny_model_dir, tmp_path):  # noqa: F811
    write_gguf(tiny_model_dir, tmp_path / "t.gguf", quant=gguf.GGMLQuantizationType.TQ2_0, tokenizer=True)
    with pytest.raises(GGUFError, match=r"quantization type TQ2_0, which this converter cannot dequantize"):
        gguf_checkpoint.check(tmp_path / "t.gguf")


def test_rotary_scaling_is_refused_not_dropped(tiny_model_dir, tmp_path):  # noqa: F811
    write_gguf(tiny_model_dir, tmp_path / "r.gguf", tokenizer=True, rope_scaling=True)
    with pytest.raises(GGUFError, match=r"rotary scaling \(linear\) is not supported"):
        gguf_checkpoint.check(tmp_path / "r.gguf")


def test_a_gguf_without_tokenizer_asks_for_one(tiny_gguf):
    path, _ = tiny_gguf
    with pytest.raises(GGUFError, match="carries no tokenizer; pass --tokenizer DIR"):
        gguf_checkpoint.check(path)
    assert gguf_checkpoint.check(path, need_tokenizer=False) == "llama"


def test_not_a_gguf_file_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        gguf_checkpoint.check(bad)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        gguf_checkpoint.check(tmp_path / "missing.gguf")


def test_cached_conversion_converts_once_and_the_gateway_never_converts(tiny_gguf, tiny_model_dir, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    with pytest.raises(NotBuiltYet, match="not converted yet"):
        gguf_checkpoint.cached_conversion(path, tmp_path, tokenizer_dir=str(tiny_model_dir), build=False)
    first = gguf_checkpoint.cached_conversion(path, tmp_path, tokenizer_dir=str(tiny_model_dir))
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = gguf_checkpoint.cached_conversion(path, tmp_path, tokenizer_dir=str(tiny_model_dir), build=False)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind
