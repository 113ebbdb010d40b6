"""The shared layers (`worker_service/layers/`): each layer's shapes and parameters, its math
against Hugging Face's module or a plain torch reference, and the attention-sinks option
(through both torch backends and through the `Attention` layer) against a per-head float64
reference and against HF gpt-oss's eager attention."""

from __future__ import annotations

import types

import pytest
import torch

from worker_service.attention import AttentionMetadata, TorchAttentionBackend
from worker_service.layers.activation import ACTIVATIONS
from worker_service.layers.attention import Attention, ForwardContext
from worker_service.layers.mlp import MLP, GatedMLP
from worker_service.layers.moe import MoEExperts, SparseMoeBlock
from worker_service.layers.norm import LayerNorm, OffsetRMSNorm, RMSNorm
from worker_service.layers.rotary import RotaryTable, apply_rotary
from worker_service.model_config import RopeConfig
from worker_service.paged_attention import CpuDecodeBackend, PagedDecodeBackend
from tests.model.test_sliding_window import _reference

BLOCK = 4


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():  # as the runner runs the model (the backends write caches with out=)
        yield


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


# --- norms -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ours,hf_name", [
    (lambda: RMSNorm(24, 1e-5), "llama.modeling_llama.LlamaRMSNorm"),
    (lambda: RMSNorm(24, 1e-5, scale_in_float32=True), "olmo2.modeling_olmo2.Olmo2RMSNorm"),
    (lambda: OffsetRMSNorm(24, 1e-5), "gemma2.modeling_gemma2.Gemma2RMSNorm"),
], ids=["llama", "olmo2", "gemma"])
def test_rms_norms_match_hf_and_keep_shape_and_dtype(ours, hf_name, dtype):
    import importlib

    module, cls = hf_name.rsplit(".", 1)
    norm = _randomize(ours(), 1).to(dtype)
    hf = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(24, eps=1e-5).to(dtype)
    hf.load_state_dict(norm.state_dict())
    x = torch.randn(5, 3, 24, generator=torch.Generator().manual_seed(2)).to(dtype)  # [..., dim]
    out = norm(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert tuple(norm.weight.shape) == (24,)
    # the rounding order is the module's: bfloat16 results agree to the last bit but for the
    # float32 sum's order (F.rms_norm against HF's pow/mean/rsqrt)
    torch.testing.assert_close(out.float(), hf(x).float(), rtol=0 if dtype == torch.float32 else 8e-3,
                               atol=1e-6 if dtype == torch.float32 else 0)


def test_the_two_rms_norm_roundings_differ_in_bfloat16():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    llama, olmo = _randomize(RMSNorm(32, 1e-6), 4).bfloat16(), RMSNorm(32, 1e-6, scale_in_float32=True).bfloat16()
    olmo.load_state_dict(llama.state_dict())
    assert not torch.equal(llama(x), olmo(x))  # the flag changes the result, so it must be the right one


def test_offset_rms_norm_starts_as_the_identity_scale():
    norm = OffsetRMSNorm(16, 1e-6)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(norm.weight, torch.zeros(16))
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_layer_norm_shapes_and_math():
    norm = _randomize(LayerNorm(16, 1e-5), 6)
    assert {n: tuple(p.shape) for n, p in norm.named_parameters()} == {"weight": (16,), "bias": (16,)}
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(7))
    assert torch.equal(norm(x), torch.nn.functional.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5))


# --- activations and MLPs ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_equal_transformers_act2fn(name):
    from transformers.activations import ACT2FN

    x = torch.randn(1000, generator=torch.Generator().manual_seed(8)) * 4
    assert torch.equal(ACTIVATIONS[name](x), ACT2FN[name](x))


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_is_down_of_act_gate_times_up(act):
    mlp = _randomize(GatedMLP(16, 40, ACTIVATIONS[act]), 9)
    assert {n: tuple(p.shape) for n, p in mlp.named_parameters()} == {
        "gate_up_proj.weight": (80, 16), "down_proj.weight": (16, 40)}
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(10))  # [n, hidden]
    gate_w, up_w = mlp.gate_up_proj.weight.split(40)  # HF's gate_proj, up_proj
    expected = (ACTIVATIONS[act](x @ gate_w.T) * (x @ up_w.T)) @ mlp.down_proj.weight.T
    out = mlp(x)
    assert out.shape == (6, 16)
    torch.testing.assert_close(out, expected)


def test_plain_mlp_shapes_and_math():
    mlp = _randomize(MLP(16, 64, ACTIVATIONS["gelu_new"]), 11)
    assert {n: tuple(p.shape) for n, p in mlp.named_parameters()} == {
        "c_fc.weight": (64, 16), "c_fc.bias": (64,), "c_proj.weight": (16, 64), "c_proj.bias": (16,)}
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(12))
    expected = ACTIVATIONS["gelu_new"](x @ mlp.c_fc.weight.T + mlp.c_fc.bias) @ mlp.c_proj.weight.T + mlp.c_proj.bias
    torch.testing.assert_close(mlp(x), expected)


# --- rotary --------------------------------------------------------------------------------------

@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_shapes_and_partial_rotation(partial):
    rope = RopeConfig(theta=10_000.0, partial_rotary_factor=partial)
    table = RotaryTable(rope, 16, 64, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 5, 63])
    cos, sin = table.lookup(positions)
    rotary_dim = int(16 * partial)
    assert cos.shape == sin.shape == (3, 1, rotary_dim)
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(13))  # [n, heads, d]
    out = apply_rotary(x, cos, sin)
    assert out.shape == x.shape
    assert torch.equal(out[0], x[0])  # position 0: no rotation
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # the unrotated tail passes
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps each head's length


# --- attention sinks through the backends -------------------------------------------------------

@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0), (5, 2.0)])
@pytest.mark.parametrize("backend", [TorchAttentionBackend, PagedDecodeBackend, CpuDecodeBackend],
                         ids=["torch", "paged", "cpu"])
def test_backends_attend_with_sinks_as_the_reference(window, softcap, backend):
    """One sequence of 23 tokens in the cache; a step of 3 decodes (at 22 and at two shorter
    lengths) then one 6-token chunk (positions 17..22); 8 query heads over 2 KV heads, each
    head its own sink (the folded GQA layout must give each query row its head's)."""
    gen = torch.Generator().manual_seed(14)
    heads, kvh, d, n = 8, 2, 8, 23
    k_all, v_all = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
    k_cache, v_cache = torch.zeros(16, BLOCK, kvh, d), torch.zeros(16, BLOCK, kvh, d)
    k_cache.view(-1, kvh, d)[:n], v_cache.view(-1, kvh, d)[:n] = k_all, v_all  # blocks 0..5 in order
    lens = [23, 9, 14]
    q = torch.randn(len(lens) + 6, heads, d, generator=gen) * 2
    sinks = torch.linspace(-2.0, 3.0, heads)  # [heads], distinct per head
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens) + 6, dtype=torch.int64),
        positions=torch.cat((torch.tensor(lens) - 1, torch.arange(17, 23))),
        block_tables=torch.arange(6).repeat(len(lens) + 1, 1), seq_lens=torch.tensor(lens + [23]),
        num_decodes=len(lens), max_decode_kv=max(lens), decode_uniform=False,
        prefill_token_index=torch.arange(len(lens), len(lens) + 6)[None], prefill_rows=torch.arange(6),
        max_prefill_kv=23)
    out = backend().attend(q, k_cache, v_cache, meta, 0.3, window, softcap, sinks=sinks)
    expected = _reference(q, k_all, v_all, meta.positions.tolist(), 0.3, window, softcap, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    plain = backend().attend(q, k_cache, v_cache, meta, 0.3, window, softcap)
    assert (out - plain).abs().max() > 1e-2  # the sinks take weight off the values


# --- the Attention layer --------------------------------------------------------------------------

def _prefill_context(n: int, heads: int, kvh: int, d: int, backend, rope: RotaryTable | None) -> ForwardContext:
    """One request's whole prompt of n tokens, its K/V in blocks 0.. in order."""
    blocks = -(-n // BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), positions=torch.arange(n), block_tables=torch.arange(blocks)[None],
        seq_lens=torch.tensor([n]), num_decodes=0, max_decode_kv=0, decode_uniform=True,
        prefill_token_index=torch.arange(n)[None], prefill_rows=torch.arange(n), max_prefill_kv=n)
    cos, sin = rope.lookup(meta.positions) if rope is not None else (None, None)
    caches = [(torch.zeros(blocks, BLOCK, kvh, d), torch.zeros(blocks, BLOCK, kvh, d))]
    return ForwardContext(meta, backend, caches, cos, sin)


@pytest.mark.parametrize("options,shapes", [
    (dict(), {"qkv_proj.weight": (64, 32), "o_proj.weight": (32, 32)}),
    (dict(qkv_bias=True, o_bias=True), {"qkv_proj.weight": (64, 32), "qkv_proj.bias": (64,),
                                        "o_proj.weight": (32, 32), "o_proj.bias": (32,)}),
    (dict(qk_norm=lambda dim: RMSNorm(dim, 1e-6)), {"qkv_proj.weight": (64, 32), "o_proj.weight": (32, 32),
                                                    "q_norm.weight": (8,), "k_norm.weight": (8,)}),
    (dict(qk_norm=lambda dim: RMSNorm(dim, 1e-6), qk_norm_per_head=False),
     {"qkv_proj.weight": (64, 32), "o_proj.weight": (32, 32), "q_norm.weight": (32,), "k_norm.weight": (16,)}),
    (dict(sinks=True), {"qkv_proj.weight": (64, 32), "o_proj.weight": (32, 32), "sinks": (4,)}),
], ids=["plain", "bias", "qk-norm-per-head", "qk-norm-whole", "sinks"])
def test_attention_parameters_and_output_shape(options, shapes):
    layer = _randomize(Attention(0, 32, 4, 2, 8, **options), 15)  # hidden 32, H 4, KVH 2, d 8
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == shapes
    rope = RotaryTable(RopeConfig(theta=10_000.0), 8, 16, torch.float32, torch.device("cpu"))
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(16))  # [n, hidden]
    out = layer(x, _prefill_context(9, 4, 2, 8, TorchAttentionBackend(), rope))
    assert out.shape == (9, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize("window", [None, 4])
def test_attention_layer_with_sinks_equals_hf_gpt_oss_eager_attention(window):
    """The layer's q/k/v and rotation, then HF gpt-oss's eager attention (sinks joined to the
    softmax) over the same causal (and windowed) mask, then o_proj."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n, hidden, heads, kvh, d = 11, 32, 4, 2, 8
    layer = _randomize(Attention(0, hidden, heads, kvh, d, sinks=True, window=window), 17)
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([-1.0, 0.5, 2.0, 4.0]))
    rope = RotaryTable(RopeConfig(theta=10_000.0), d, 16, torch.float32, torch.device("cpu"))
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(18))
    ctx = _prefill_context(n, heads, kvh, d, TorchAttentionBackend(), rope)
    with torch.no_grad():
        out = layer(x, ctx)
        qk, v = layer.project(x)
        q, k = apply_rotary(qk, ctx.cos, ctx.sin).split((heads, kvh), dim=1)  # [n, H, d], [n, KVH, d]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) if window is None else (j <= i) & (j > i - window)
        mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]  # [1, 1, n, n]
        module = types.SimpleNamespace(sinks=layer.sinks, num_key_value_groups=heads // kvh, training=False)
        hf_out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                            v.transpose(0, 1)[None], mask, layer.scale)  # [1, n, H, d]
        expected = layer.o_proj(hf_out.reshape(n, heads * d))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_very_negative_sinks_are_no_sinks():
    layer = _randomize(Attention(0, 32, 4, 2, 8, sinks=True), 19)
    with torch.no_grad():
        layer.sinks.fill_(-1e4)
    plain = Attention(0, 32, 4, 2, 8)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "sinks"})
    rope = RotaryTable(RopeConfig(theta=10_000.0), 8, 16, torch.float32, torch.device("cpu"))
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(20))
    with torch.no_grad():
        torch.testing.assert_close(layer(x, _prefill_context(7, 4, 2, 8, TorchAttentionBackend(), rope)),
                                   plain(x, _prefill_context(7, 4, 2, 8, TorchAttentionBackend(), rope)))


# --- MoE -------------------------------------------------------------------------------------------

def _moe_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token: Σ over its top-k experts of weight * down(silu(gate(x)) * up(x))."""
    probs = torch.softmax(block.gate(x).double(), dim=-1)  # [n, E]
    weights, experts = torch.topk(probs, block.top_k, dim=-1)
    if block.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    e = block.experts
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, j in zip(weights[t].tolist(), experts[t].tolist()):
            gate, up = e.gate_up_proj[2 * j].double(), e.gate_up_proj[2 * j + 1].double()  # [I, hidden] each
            h = torch.nn.functional.silu(x[t].double() @ gate.T) * (x[t].double() @ up.T)  # [I]
            out[t] += w * (h @ e.down_proj[j].double().T)
    return out.float()


@pytest.mark.parametrize("renormalize", [True, False])
def test_sparse_moe_block_shapes_and_a_per_token_reference(renormalize):
    block = _randomize(SparseMoeBlock(16, 5, 2, 12, renormalize=renormalize, cast_weights=False), 21)
    assert {n: tuple(p.shape) for n, p in block.named_parameters()} == {
        "gate.weight": (5, 16), "experts.gate_up_proj": (10, 12, 16), "experts.down_proj": (5, 16, 12)}
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(22))  # [n, hidden]
    with torch.no_grad():
        out = block(x)
    assert out.shape == (13, 16)
    torch.testing.assert_close(out, _moe_reference(block, x), rtol=1e-5, atol=1e-5)


def test_expert_shares_sum_to_all_experts():
    """Expert parallelism's shares ([0, 2) and [2, 5) of 5 experts) add up to the whole block."""
    full = _randomize(SparseMoeBlock(16, 5, 2, 12, renormalize=True, cast_weights=False), 23)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(24))
    weights, experts = torch.topk(torch.softmax(full.gate(x), -1), 2, dim=-1)
    total = torch.zeros(9, 16)
    for first, held in ((0, 2), (2, 3)):
        share = MoEExperts(held, 16, 12, first, 5)
        with torch.no_grad():
            share.gate_up_proj.copy_(full.experts.gate_up_proj[2 * first : 2 * (first + held)])
            share.down_proj.copy_(full.experts.down_proj[first : first + held])
            total += share(x, weights, experts)
    with torch.no_grad():
        torch.testing.assert_close(total, full.experts(x, weights, experts), rtol=1e-5, atol=1e-6)
