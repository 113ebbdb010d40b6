"""Built-in offline models: real HF checkpoints, deterministic, cached atomically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from model_zoo import builtin_models
from model_zoo.builtin_models import BUILTIN_MODELS, cache_dir, ensure_model, get_spec, resolve_model
from cli import main as cli_main
from worker_service.model_config import ModelConfig
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401

# What the assignment specifies for each size, independent of the ModelSpec table.
EXPECTED_GEOMETRY = {
    "tiny": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=4096, intermediate_size=512, tie_word_embeddings=False, max_position_embeddings=2048,
    ),
    "100m": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        vocab_size=32000, intermediate_size=2048, tie_word_embeddings=True, max_position_embeddings=2048,
    ),
}
APPROX_PARAMS = {"tiny": 4e6, "100m": 100e6}


def _meta_model(name: str):
    """The HF Llama for a built-in spec on the meta device: counts parameters without memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**EXPECTED_GEOMETRY[name])
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def declared_parameters(geometry: dict) -> int:
    """The parameter count the model's family declares (`ModelFamily.counts`) for this geometry."""
    from transformers import LlamaConfig

    return ModelConfig.from_dict(LlamaConfig(**geometry).to_dict()).num_parameters()


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_spec_geometry_and_parameter_count(name: str) -> None:
    spec = get_spec(name)
    for field, value in EXPECTED_GEOMETRY[name].items():
        assert getattr(spec, field) == value, field
    actual = _meta_model(name).num_parameters()
    assert declared_parameters(EXPECTED_GEOMETRY[name]) == actual  # the llama family's declaration

    assert abs(actual - APPROX_PARAMS[name]) / APPROX_PARAMS[name] < 0.15


def test_tiny_loads_with_auto_classes(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    assert (tiny_model_dir / "model.safetensors").is_file()
    assert not list(tiny_model_dir.glob("*.bin"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    spec = get_spec("tiny")
    assert model.config.model_type == "llama"
    for field, value in EXPECTED_GEOMETRY["tiny"].items():
        assert getattr(model.config, field) == value, field
    assert model.num_parameters() == ModelConfig.from_dir(tiny_model_dir).num_parameters()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(tokenizer) == spec.vocab_size
    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    assert tokenizer.eos_token_id in generation.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation.eos_token_id
    assert model.config.bos_token_id == tokenizer.bos_token_id


def test_tiny_greedy_output_is_not_degenerate(tiny_model_dir: Path, tiny_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt = tiny_tokenizer("def fibonacci(n):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    new_tokens = out[0, prompt.shape[1]:].tolist()
    assert len(new_tokens) == 32
    assert len(set(new_tokens)) >= 8, new_tokens


def test_tokenizer_specials_and_bos(tiny_tokenizer) -> None:
    ids = {t: tiny_tokenizer.convert_tokens_to_ids(t) for t in ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")}
    assert list(ids.values()) == [0, 1, 2, 3, 4]
    assert tiny_tokenizer.pad_token_id == 0 and tiny_tokenizer.bos_token_id == 1 and tiny_tokenizer.eos_token_id == 2
    encoded = tiny_tokenizer("import os").input_ids
    assert encoded[0] == 1 and 1 not in encoded[1:]
    assert tiny_tokenizer("import os", add_special_tokens=False).input_ids == encoded[1:]
    # The vocabulary was learned from Python source: common keywords are single tokens.
    assert len(tiny_tokenizer("return", add_special_tokens=False).input_ids) == 1


@given(st.text())
def test_tokenizer_round_trips_arbitrary_unicode(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert tiny_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", ["日本語のテキスト", "emoji 😀👨‍👩‍👧 flags 🇫🇷", "é vs e\u0301 \u200b\t\r\n", "\x00\x7f\U0010ffff"])
def test_tokenizer_round_trips_multibyte(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert tiny_tokenizer.decode(ids) == text


def test_chat_template_renders_chatml(tiny_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == rendered.removesuffix("<|im_start|>assistant\n")
    ids = tiny_tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[0] == tiny_tokenizer.bos_token_id
    assert ids.count(tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tiny_tokenizer.decode(ids) == rendered


def test_an_out_that_cannot_be_a_directory_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    """It was a NotADirectoryError traceback."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    assert cli_main(["make-model", "--size", "tiny", "--out", str(taken)]) == 2
    assert capsys.readouterr().err.strip() == f"stepahead make-model: --out {taken}: Not a directory"


def test_two_builds_are_byte_identical(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    assert cli_main(["make-model", "--size", "tiny", "--out", str(out)]) == 0
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_build_refuses_non_empty_dir_and_unknown_name(tmp_path: Path) -> None:
    (tmp_path / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        builtin_models.build_model("tiny", tmp_path)
    with pytest.raises(ValueError, match="unknown built-in model 'huge'"):
        builtin_models.build_model("huge", tmp_path / "new")


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STEPAHEAD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "stepahead"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "stepahead"
    monkeypatch.setenv("STEPAHEAD_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


def _fake_builder(calls: list[Path]):
    def build(name: str, out_dir: Path) -> Path:
        calls.append(Path(out_dir))
        (Path(out_dir) / "config.json").write_text(f'{{"built_by": "{name}"}}')
        return Path(out_dir)

    return build


def test_ensure_model_builds_once_into_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STEPAHEAD_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(builtin_models, "build_model", _fake_builder(calls))
    path = ensure_model("tiny")
    assert path == tmp_path / "models" / "tiny"
    assert (path / "config.json").read_text() == '{"built_by": "tiny"}'
    assert len(calls) == 1 and calls[0].parent == tmp_path / "models" and calls[0] != path
    assert ensure_model("tiny") == path and len(calls) == 1
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]  # no staging left


def test_ensure_model_loses_race_gracefully(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another process finishes first, between our build and our rename: we use its copy."""
    monkeypatch.setenv("STEPAHEAD_CACHE_DIR", str(tmp_path))
    winner = tmp_path / "models" / "tiny"

    def build_while_other_wins(name: str, out_dir: Path) -> Path:
        (Path(out_dir) / "config.json").write_text("ours")
        winner.mkdir()
        (winner / "config.json").write_text("theirs")
        return Path(out_dir)

    monkeypatch.setattr(builtin_models, "build_model", build_while_other_wins)
    assert ensure_model("tiny") == winner
    assert (winner / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]


def test_ensure_model_failed_build_leaves_no_trace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STEPAHEAD_CACHE_DIR", str(tmp_path))

    def broken(name: str, out_dir: Path) -> Path:
        (Path(out_dir) / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(builtin_models, "build_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_model("tiny")
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.slow
def test_ensure_model_two_real_processes_race(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two processes build the same cached model at once: both get one complete copy."""
    import os

    env = {**os.environ, "STEPAHEAD_CACHE_DIR": str(tmp_path)}
    code = "from model_zoo.builtin_models import ensure_model; print(ensure_model('tiny'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    target = tmp_path / "models" / "tiny"
    assert outputs == [str(target), str(target)]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (target / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_resolve_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path) -> None:
    monkeypatch.setenv("STEPAHEAD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    assert resolve_model("tiny") == tmp_path / "cache" / "models" / "tiny"
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ValueError, match="neither a built-in model"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_cli_module_imports_are_light() -> None:
    code = (
        "import sys, model_zoo.builtin_models, model_zoo.tokenizer_train;"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_100m_builds_and_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = builtin_models.build_model("100m", tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.num_parameters() == ModelConfig.from_dir(out).num_parameters()
    assert len(tokenizer) == 32000
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
