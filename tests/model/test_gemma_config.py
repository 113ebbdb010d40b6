"""Gemma 2 / Gemma 3 config.json as transformers' config classes read it (both the 5.x layout
the test checkpoints use and the older one of the published checkpoints), and the values the
families refuse, each named."""

from __future__ import annotations

import json

import pytest

from testing.checkpoints import hf_config
from worker_service.model_config import CheckpointError, ModelConfig
from worker_service.models.gemma_spec import GEMMA2, GEMMA3_TEXT
from worker_service.models.interface import LayerType


def _saved(tmp_path, model_type, edit=None, drop=(), **overrides) -> dict:
    hf_config(model_type, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **overrides
              ).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for name in drop:
        raw.pop(name, None)
    raw.update(edit or {})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return raw


@pytest.mark.parametrize("fam", [GEMMA2, GEMMA3_TEXT], ids=lambda f: f.model_type)
def test_the_defaults_are_those_of_transformers_config_class(fam):
    from transformers import AutoConfig

    hf = AutoConfig.for_model(fam.model_type)
    for name, value in fam.defaults:
        if name == "rope_theta":
            assert hf.rope_parameters["full_attention"]["rope_theta"] == value
        elif name == "rope_local_base_freq":
            assert hf.rope_parameters["sliding_attention"]["rope_theta"] == value
        else:
            assert getattr(hf, name) == value, name


@pytest.mark.parametrize("model_type, pattern, layers", [("gemma2", None, 5), ("gemma3_text", None, 13),
                                                           ("gemma3_text", 3, 7)])
def test_layer_types_without_the_field_follow_the_pattern_as_transformers_does(model_type, pattern, layers,
                                                                                 tmp_path):
    from transformers import AutoConfig

    extra = {} if pattern is None else {"sliding_window_pattern": pattern}
    _saved(tmp_path, model_type, edit=extra, drop=("layer_types",), num_hidden_layers=layers)
    expected = AutoConfig.for_model(model_type, num_hidden_layers=layers, **extra).layer_types
    cfg = ModelConfig.from_dir(tmp_path)
    assert [t.value for t in cfg.layer_types] == expected
    assert [cfg.layer_window(i) for i in range(layers)] == [
        cfg.sliding_window if t == "sliding_attention" else None for t in expected]


def test_gemma3_older_layout_rope_theta_and_rope_local_base_freq(tmp_path):
    """transformers 4.x: rope_theta (global layers) and rope_local_base_freq (sliding ones)."""
    _saved(tmp_path, "gemma3_text", edit={"rope_theta": 250_000.0, "rope_local_base_freq": 5_000.0,
                                          "rope_scaling": None}, drop=("rope_parameters",))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.rope.theta == 250_000.0 and cfg.rope.rope_type == "default" and cfg.rope_local_theta == 5_000.0


def test_gemma3_per_layer_type_rope_parameters(tmp_path):
    _saved(tmp_path, "gemma3_text", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 7_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 300_000.0}})
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.rope.theta, cfg.rope_local_theta) == (300_000.0, 7_000.0)


@pytest.mark.parametrize("model_type, edit, named", [
    ("gemma2", {"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "unsupported use_bidirectional_attention True"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "unsupported attn_logit_softcapping 50.0 for gemma3_text"),
    ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be > 0"),
    ("gemma2", {"final_logit_softcapping": -1.0}, "final_logit_softcapping must be > 0"),
    ("gemma2", {"sliding_window": -4}, "sliding_window must be >= 1"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]},
     "unsupported layer_types\\[1\\] 'chunked_attention'"),
    ("gemma2", {"layer_types": ["sliding_attention"]}, "layer_types must list one type per layer"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "unsupported rope_parameters.sliding_attention rope_type 'linear'"),
])
def test_settings_it_does_not_implement_are_refused_naming_the_field(model_type, edit, named, tmp_path):
    _saved(tmp_path, model_type, edit=edit, num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dir(tmp_path)


def test_llama_ignores_sliding_window_as_transformers_does(tmp_path):
    _saved(tmp_path, "llama", edit={"sliding_window": 8})
    assert ModelConfig.from_dir(tmp_path).sliding_window is None
    assert ModelConfig.from_dir(tmp_path).layer_window(0) is None


def test_a_mistral_window_applies_to_every_layer(tmp_path):
    _saved(tmp_path, "mistral", sliding_window=8, num_hidden_layers=3)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.layer_types == () and [cfg.layer_window(i) for i in range(3)] == [8, 8, 8]
    assert LayerType.SLIDING.value == "sliding_attention"
