"""Rope parsing and frequencies against transformers' own `ROPE_INIT_FUNCTIONS`: the inverse
frequencies and the attention scaling of every supported rope type, from the same config.json;
the per-position rule of the length-dependent types against HF's function at that length; and
the refusals, naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from testing.checkpoints import hf_config
from worker_service.model_config import SUPPORTED_ROPE_TYPES, ModelConfig
from worker_service.layers.rotary import RotaryTable, angles, apply_rotary, attention_scaling, inv_freq

LONG = [1.0 + 0.25 * i for i in range(8)]  # longrope factors for 16 rotated dims (8 frequencies)
SHORT = [1.0 + 0.01 * i for i in range(8)]

# (model_type, config.json overrides) per case; head_dim 16 (hidden 64, 4 heads)
CASES = {
    "default": ("llama", dict(rope_theta=5000.0)),
    "linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "dynamic": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 3.0}, max_position_embeddings=32)),
    "yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32})),
    "yarn_betas_untruncated": ("llama", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 16, "beta_slow": 2, "truncate": False,
        "original_max_position_embeddings": 64})),
    "yarn_mscale": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                                "mscale_all_dim": 0.707, "original_max_position_embeddings": 32})),
    "yarn_attention_factor": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                          "attention_factor": 1.5})),
    "longrope": ("llama", dict(rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                             "original_max_position_embeddings": 32})),
    "llama3": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Phi-3-128k's config.json: top-level original_max_position_embeddings, factor from the lengths
    "phi3_longrope": ("phi3", dict(rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                                   original_max_position_embeddings=32, max_position_embeddings=256)),
    # its old name (transformers 5 finds the trained length in rope_scaling only for this one)
    "phi3_su": ("phi3", dict(rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG,
                                           "original_max_position_embeddings": 32},
                             original_max_position_embeddings=32, max_position_embeddings=256)),
    # Phi-4-mini: longrope over the first 3/4 of each head (12 of 16 dims: 6 frequencies)
    "phi3_partial_longrope": ("phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=32,
                                           max_position_embeddings=128,
                                           rope_scaling={"type": "longrope", "short_factor": SHORT[:6],
                                                         "long_factor": LONG[:6]})),
    "phi3_partial": ("phi3", dict(partial_rotary_factor=0.5)),
}


def configs(name: str):
    """(our ModelConfig, HF's config) from one config.json."""
    model_type, overrides = CASES[name]
    hf = hf_config(model_type, num_attention_heads=4, **overrides)
    ours = ModelConfig.from_dict(hf.to_dict())
    return ours, hf


def hf_rope(hf, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":  # each modeling file computes it itself (Phi3's over rotary_dim)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        module = {"llama": LlamaRotaryEmbedding, "phi3": Phi3RotaryEmbedding}[hf.model_type]
        return module.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=seq_len)


def test_every_supported_type_is_covered():
    ours = {configs(name)[0].rope.rope_type for name in CASES}
    assert ours == set(SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_and_attention_scaling_equal_hf(name):
    ours, hf = configs(name)
    freq, scaling = hf_rope(hf)
    mine = inv_freq(ours.rope, ours.head_dim)
    assert mine.shape == freq.shape
    torch.testing.assert_close(mine, freq.float(), rtol=1e-6, atol=0)
    assert attention_scaling(ours.rope) == pytest.approx(scaling, rel=1e-12)


@pytest.mark.parametrize("name", ["dynamic", "longrope", "phi3_longrope", "phi3_partial_longrope"])
def test_each_position_rotates_as_hf_for_a_sequence_ending_there(name):
    """Position p's frequencies are HF's for a sequence of p + 1 tokens: the plain / short ones
    below the trained length, the grown / long ones at and past it (what HF's generate rotates
    each decode step's one position by)."""
    ours, hf = configs(name)
    trained = ours.rope.original_max_position_embeddings
    max_len = trained + 20
    table = angles(ours.rope, ours.head_dim, max_len)  # [max_len, rotary_dim/2]
    for p in (0, trained - 2, trained - 1, trained, trained + 1, max_len - 1):
        freq, _ = hf_rope(hf, seq_len=torch.tensor(p + 1))
        torch.testing.assert_close(table[p], p * freq.float(), rtol=1e-6, atol=0, msg=f"position {p}")
    # the two sides differ: the test would see a rule that ignored the length
    assert not torch.allclose(table[trained] / trained, table[trained - 1] / (trained - 1))


def test_dynamic_serves_factor_times_its_trained_length():
    ours, _ = configs("dynamic")
    assert ours.rope.max_positions(ours.max_position_embeddings) == 96
    from worker_service.model_config import resolve_max_model_len

    assert resolve_max_model_len(ours, None) == 96
    plain, _ = configs("linear")
    assert resolve_max_model_len(plain, None) == plain.max_position_embeddings


def test_partial_rotary_rotates_the_first_dims_as_hf_phi3():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    ours, hf = configs("phi3_partial_longrope")
    torch.manual_seed(0)
    n, heads, d = 50, 3, ours.head_dim
    x = torch.randn(n, heads, d)
    positions = torch.arange(n)
    table = RotaryTable(ours.rope, d, 64, torch.float32, torch.device("cpu"))
    assert table.cos.shape == (64, 12)
    mine = apply_rotary(x, *table.lookup(positions))
    for end in (20, n):  # a sequence within the trained length (32), and one past it: HF by its whole length
        cos, sin = Phi3RotaryEmbedding(hf)(x, positions[None, :end])  # [1, end, rotary_dim]
        q = x[:end].transpose(0, 1)[None]  # [1, heads, end, d]
        theirs, _ = apply_rotary_pos_emb(q, q, cos, sin)
        theirs = theirs[0].transpose(0, 1)  # [end, heads, d]
        # past the trained length HF rotates the whole sequence by the long factors: equal from there
        start = 0 if end <= 32 else 32
        torch.testing.assert_close(mine[start:end], theirs[start:end], rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[..., 12:], x[..., 12:])  # the unrotated dims pass through


def _raw(model_type: str = "llama", **overrides) -> dict:
    raw = hf_config(model_type, num_attention_heads=4).to_dict()
    raw.pop("rope_parameters", None)
    raw.update(overrides)
    return raw


@pytest.mark.parametrize("edit, named", [
    (dict(rope_scaling={"rope_type": "proportional", "factor": 2.0}),
     r"unsupported rope type 'proportional' in rope_scaling; supported: \('default', 'linear', 'dynamic', "
     r"'yarn', 'longrope', 'llama3'\)"),
    (dict(rope_parameters={"rope_type": "ntk", "rope_theta": 1e4}), "unsupported rope type 'ntk' in rope_parameters"),
    (dict(rope_scaling={"rope_type": "linear"}), r"rope_scaling.factor is missing \(rope type 'linear'\)"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": "2"}), "rope_scaling.factor must be a positive number"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 0.5}), "rope_scaling.factor must be >= 1"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "beta_fast": "fast"}),
     "rope_scaling.beta_fast must be a positive number"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "truncate": "no"}), "rope_scaling.truncate must be"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0}),
     "rope_scaling.attention_factor must be a positive number"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     "rope_scaling.high_freq_factor is missing"),
    (dict(rope_scaling={"rope_type": "longrope", "long_factor": LONG}), "rope_scaling.short_factor is missing"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3]}),
     "rope_scaling.long_factor has 3 entries; the rotated 16 dims of each head need 8"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": "1", "long_factor": LONG}),
     "rope_scaling.short_factor must be a list of positive numbers"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}, original_max_position_embeddings="4k"),
     "original_max_position_embeddings must be an integer"),
    (dict(partial_rotary_factor=0.5), "unsupported partial_rotary_factor 0.5 .* for model_type 'llama'"),
])
def test_bad_rope_settings_are_refused_naming_the_field(edit, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict(_raw(**edit))


@pytest.mark.parametrize("edit, named", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "unsupported rope type 'yarn' for model_type 'phi3'"),
    (dict(partial_rotary_factor=1.5), r"partial_rotary_factor must be a number in \(0, 1\], got 1.5"),
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor 0.1 rotates 1 of head_dim 16: must be an even number"),
])
def test_phi3_refuses_what_phi3config_refuses(edit, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict(_raw("phi3", **edit))


def test_longrope_attention_factor_follows_the_lengths():
    """Phi-3-128k: no factor, max_position_embeddings 131072 over 4096 trained."""
    ours, _ = configs("phi3_longrope")
    assert ours.rope.factor == 8.0
    assert attention_scaling(ours.rope) == pytest.approx(math.sqrt(1 + math.log(8.0) / math.log(32)))


def test_phi3_without_a_top_level_trained_length_takes_phi3configs_default():
    """Phi3Config's original_max_position_embeddings defaults to 4096 and wins over rope_scaling's."""
    from transformers import Phi3Config

    short, long = [1.0] * 8, [2.0] * 8
    raw = _raw("phi3", max_position_embeddings=16384, rope_scaling={
        "type": "longrope", "short_factor": short, "long_factor": long, "original_max_position_embeddings": 64})
    raw.pop("original_max_position_embeddings")
    ours = ModelConfig.from_dict(raw)
    hf = Phi3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ours.rope.original_max_position_embeddings == hf.rope_parameters["original_max_position_embeddings"] == 4096
    assert attention_scaling(ours.rope) == pytest.approx(hf_rope(hf)[1])
