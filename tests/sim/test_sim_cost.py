"""The roofline cost model and the accelerator profiles."""

from __future__ import annotations

import json

import pytest

from model_zoo.sim_models import SIM_MODELS, sim_config
from worker_service.model_config import ModelConfig
from worker_service.sim.cost import CostModel, ModelGeometry
from worker_service.sim.profiles import BUILTIN_PROFILES, AcceleratorProfile, load_profile


def geometry(name: str, dtype: str = "bfloat16") -> ModelGeometry:
    cfg = ModelConfig.from_dict(sim_config(SIM_MODELS[name]))  # the built-in's config.json, bar token ids
    return ModelGeometry.from_config(cfg, dtype)


@pytest.mark.parametrize("name,published", [("llama3-8b-sim", 8.03e9), ("llama3-70b-sim", 70.55e9),
                                            ("qwen3-30b-a3b-sim", 30.5e9), ("mixtral-8x7b-sim", 46.7e9)])
def test_parameter_count_matches_the_published_size(name, published):
    assert geometry(name).num_parameters == pytest.approx(published, rel=0.005)


@pytest.mark.parametrize("name,active", [("qwen3-30b-a3b-sim", 3.3e9), ("mixtral-8x7b-sim", 12.9e9),
                                         ("llama3-8b-sim", 8.03e9)])
def test_moe_active_parameters_are_the_published_ones(name, active):
    """Active per token: the dense weights (attention, routers, embedding and head, norms) and
    top_k of E experts per layer; a dense model's are all of them."""
    g = geometry(name)
    dense = g.num_parameters - g.expert_params
    ours = dense + g.expert_params * g.experts_per_token / max(g.num_experts, 1)
    assert ours == pytest.approx(active, rel=0.02)
    assert g.active_params_per_token == g.linear_params + (g.expert_params * g.experts_per_token
                                                           // max(g.num_experts, 1))
    if g.expert_params:
        assert g.expert_params > 0.9 * g.num_parameters  # the experts are most of an MoE model


def test_moe_step_reads_the_experts_its_tokens_are_routed_to():
    """Qwen3-30B-A3B (128 experts, top-8): one decode token reads the dense part and 8/128 of the
    experts; 64 tokens read 1 - (120/128)^64 of them (98.4%), a long prefill all; the FLOPs are
    the active parameters'."""
    g = geometry("qwen3-30b-a3b-sim")
    model = CostModel(g, BUILTIN_PROFILES["h200"])
    dense_bytes = (g.num_parameters - g.lookup_params - g.expert_params) * g.dtype_bytes
    expert_bytes = g.expert_params * g.dtype_bytes
    kv = g.kv_bytes_per_token
    one = model.step([(100, 1)], num_sampled=1)
    assert one.bytes == pytest.approx(dense_bytes + expert_bytes * 8 / 128 + 102 * kv)
    batch = model.step([(100, 1)] * 64, num_sampled=64)
    assert batch.bytes == pytest.approx(dense_bytes + expert_bytes * (1 - (120 / 128) ** 64) + 64 * 102 * kv)
    prefill = model.step([(0, 4096)], num_sampled=1)
    assert prefill.bytes == pytest.approx(g.weight_bytes_read_per_step + 2 * 4096 * kv)
    attention = 4 * g.num_layers * g.num_heads * g.head_dim * (4096 * 4097 // 2)
    assert prefill.flops == 2 * g.active_params_per_token * 4096 + 2 * g.lm_head_params + attention
    assert g.active_params_per_token < g.linear_params + g.expert_params / 10
    # a decode of the MoE model reads far less than its weights
    assert one.bytes < 0.2 * g.weight_bytes and one.memory_bound


def test_mixtral_decode_is_cheaper_than_a_dense_model_of_its_size_but_not_than_its_active_size():
    h200 = BUILTIN_PROFILES["h200"]
    mixtral = CostModel(geometry("mixtral-8x7b-sim"), h200, num_devices=2)
    llama70 = CostModel(geometry("llama3-70b-sim"), h200, num_devices=2)
    llama8 = CostModel(geometry("llama3-8b-sim"), h200, num_devices=2)
    decode = [(500, 1)]
    assert llama8.step(decode, 1).seconds < mixtral.step(decode, 1).seconds < llama70.step(decode, 1).seconds


def test_llama32_1b_geometry_and_decode_step_from_its_published_shape():
    """Llama-3.2-1B (hidden 2048, MLP 8192, 16 layers, 32 heads of 64, 8 KV heads, 128,256
    vocab, tied embeddings): the parameters counted from that shape by hand, and a decode
    step at 256 / 512 streams of mean context 640 (512-token prompts, halfway through 256
    outputs) is the weights plus the KV context read at the H200's effective bandwidth."""
    hidden, mlp, layers, heads, kv_heads, head_dim, vocab = 2048, 8192, 16, 32, 8, 64, 128256
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * hidden * mlp + 2 * hidden  # gate, up, down; two norms
    params = vocab * hidden + layers * per_layer + hidden  # one embedding (tied), final norm
    g = geometry("llama3.2-1b-sim")
    assert g.num_parameters == params
    assert g.num_parameters == pytest.approx(1.24e9, rel=0.005)  # the model card's size
    assert g.lookup_params == 0 and g.lm_head_params == vocab * hidden  # the tied matrix is read as the head
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    assert g.kv_bytes_per_token == kv_per_token
    h200 = BUILTIN_PROFILES["h200"]
    model = CostModel(g, h200)
    bandwidth = h200.memory_bandwidth * h200.bandwidth_efficiency
    for streams in (256, 512):
        step = model.step([(640, 1)] * streams, num_sampled=streams)
        expect = h200.step_overhead_s + (params * 2 + streams * (641 + 1) * kv_per_token) / bandwidth
        assert step.memory_bound and step.seconds == pytest.approx(expect)
    # the decode steps are short: well under the 8B model's at the same batch
    big = CostModel(geometry("llama3-8b-sim"), h200).step([(640, 1)] * 256, num_sampled=256)
    assert model.step([(640, 1)] * 256, num_sampled=256).seconds < big.seconds / 2


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
