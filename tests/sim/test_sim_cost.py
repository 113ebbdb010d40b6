"""The roofline cost model and the accelerator profiles."""

from __future__ import annotations

import json

import pytest

from model_zoo.sim_models import SIM_MODELS
from worker_service.model_config import ModelConfig
from worker_service.sim.cost import CostModel, ModelGeometry
from worker_service.sim.profiles import BUILTIN_PROFILES, AcceleratorProfile, load_profile


def geometry(name: str, dtype: str = "bfloat16") -> ModelGeometry:
    s = SIM_MODELS[name]
    cfg = ModelConfig.from_dict({
        "model_type": "llama", "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "vocab_size": s.vocab_size,
    })
    return ModelGeometry.from_config(cfg, dtype)


@pytest.mark.parametrize("name,published", [("llama3-8b-sim", 8.03e9), ("llama3-70b-sim", 70.55e9)])
def test_parameter_count_matches_the_published_size(name, published):
    assert geometry(name).num_parameters == pytest.approx(published, rel=0.005)


def test_kv_bytes_per_token_of_llama3_8b():
    # 2 (K and V) * 32 layers * 8 kv heads * 128 dims * 2 bytes
    assert geometry("llama3-8b-sim").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_decode_is_memory_bound_and_long_prefill_compute_bound():
    model = CostModel(geometry("llama3-8b-sim"), BUILTIN_PROFILES["h200"])
    decode = model.step([(500, 1)] * 64, num_sampled=64)
    prefill = model.step([(0, 2048)], num_sampled=1)
    assert decode.memory_bound and not prefill.memory_bound
    g, p = model.geometry, model.profile
    expect = p.step_overhead_s + decode.bytes / (p.memory_bandwidth * p.bandwidth_efficiency)
    assert decode.seconds == pytest.approx(expect)
    assert decode.bytes == g.weight_bytes_read_per_step + 64 * 501 * g.kv_bytes_per_token + 64 * g.kv_bytes_per_token


def test_step_time_grows_with_context_and_shrinks_with_bandwidth():
    g = geometry("llama3-8b-sim")
    h100, h200 = (CostModel(g, BUILTIN_PROFILES[n]) for n in ("h100", "h200"))
    short, long = ([(c, 1)] * 256 for c in (128, 4096))
    assert h200.step(long, 256).seconds > h200.step(short, 256).seconds
    assert h100.step(long, 256).seconds > h200.step(long, 256).seconds


def test_kv_pool_is_memory_minus_weights():
    g = geometry("llama3-8b-sim")
    blocks = CostModel(g, BUILTIN_PROFILES["h200"]).num_kv_blocks(16, 0.9)
    free = 141e9 * 0.9 - g.weight_bytes - 2 * 2**30
    assert blocks == int(free // (16 * g.kv_bytes_per_token))


def test_70b_does_not_fit_one_h100_but_fits_four():
    g = geometry("llama3-70b-sim")
    with pytest.raises(ValueError, match="sim-num-devices"):
        CostModel(g, BUILTIN_PROFILES["h100"]).num_kv_blocks(16, 0.9)
    assert CostModel(g, BUILTIN_PROFILES["h100"], num_devices=4).num_kv_blocks(16, 0.9) > 10_000


def test_profile_from_a_json_file(tmp_path):
    path = tmp_path / "mi300x.json"
    path.write_text(json.dumps({"memory_bytes": 192e9, "memory_bandwidth": 5.3e12, "peak_flops": 1307e12,
                                "host_link_bandwidth": 64e9}))
    profile = load_profile(str(path))
    assert profile == AcceleratorProfile("mi300x", 192e9, 5.3e12, 1307e12, 64e9)


@pytest.mark.parametrize("content,message", [
    ({"memory_bytes": 1e9}, "missing"),
    ({"memory_bytes": 1e9, "memory_bandwidth": 1e12, "peak_flops": 1e14, "host_link_bandwidth": 1e9, "hbm": 3},
     "unknown keys"),
    ({"memory_bytes": -1, "memory_bandwidth": 1e12, "peak_flops": 1e14, "host_link_bandwidth": 1e9},
     "memory_bytes must be positive"),
    ({"memory_bytes": 1e9, "memory_bandwidth": 1e12, "peak_flops": 1e14, "host_link_bandwidth": 1e9,
      "compute_efficiency": 1.5}, "compute_efficiency must be at most 1"),
    ({"memory_bytes": "80GB", "memory_bandwidth": 1e12, "peak_flops": 1e14, "host_link_bandwidth": 1e9},
     "memory_bytes must be a finite number"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_profile_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_profile(str(path))


def test_unknown_profile_name():
    with pytest.raises(ValueError, match="neither a built-in"):
        load_profile("tpu-v9")
