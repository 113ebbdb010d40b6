"""The CPU layer kernels (`worker_service/cpu_kernels.py`: residual add + RMSNorm, RMSNorm, SiLU·mul, rotary
in place) against the torch ops they replace, on the shapes a step gives them: one row to a
batch, widths that are no multiple of the vector width, strided rows (views into a fused
projection); and the layers that take them equal to themselves with the torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_service import cpu_kernels
from worker_service.layers.attention import Attention
from worker_service.layers.mlp import GatedMLP
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import apply_rotary


ROWS = [1, 7, 64]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 37])
def test_add_rms_norm_equals_the_add_then_the_norm(kernels, rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width + 5, generator=gen)[:, :width]  # strided rows
    delta = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    total, normed = kernels.add_rms_norm(x, delta, weight, 1e-5)
    torch.testing.assert_close(total, x + delta, rtol=0, atol=0)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (width,), weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 37])
def test_rms_norm_equals_torchs(kernels, rows, width):
    gen = torch.Generator().manual_seed(rows * width + 1)
    x = torch.randn(rows, width + 5, generator=gen)[:, :width] * 3  # strided rows
    weight = torch.randn(width, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), F.rms_norm(x, (width,), weight, 1e-6),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 45])
def test_silu_and_mul_equals_silu_times_up(kernels, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter + 3, generator=gen)[:, : 2 * inter] * 8  # strided rows, wide range
    gate_up[0, :4] = torch.tensor([-200.0, -88.0, 0.0, 200.0])  # the exp's clamps
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rotary_in_place_equals_apply_rotary(kernels, rows, head_dim):
    gen = torch.Generator().manual_seed(rows * head_dim)
    qkv = torch.randn(rows, 5 * head_dim, generator=gen)
    qk = qkv[:, : 4 * head_dim].view(rows, 4, head_dim)  # q and k heads of a fused projection: strided
    cos = torch.randn(rows, 1, head_dim, generator=gen)
    sin = torch.randn(rows, 1, head_dim, generator=gen)
    v_before = qkv[:, 4 * head_dim :].clone()
    expected = apply_rotary(qk, cos, sin)
    kernels.rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 4 * head_dim :], v_before), "the rotation wrote past the q/k heads"


def test_bad_inputs_are_refused_not_read_out_of_bounds(kernels):
    with pytest.raises(RuntimeError, match="add_rms_norm"):
        kernels.add_rms_norm(torch.randn(3, 8), torch.randn(3, 9), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernels.rms_norm(torch.randn(3, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.silu_and_mul(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rotary_"):
        kernels.rotary_(torch.randn(3, 2, 8), torch.randn(3, 1, 6), torch.randn(3, 1, 6))


def test_layers_with_the_kernels_equal_themselves_without(kernels):
    """RMSNorm (and its add_and_norm), the SiLU gated MLP and rotary attention's rotation take the kernels
    once attached, and give what the torch ops give; a GeGLU MLP does not take them."""
    torch.manual_seed(0)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.normal_()
    mlp = GatedMLP(48, 40, F.silu)
    geglu = GatedMLP(48, 40, lambda x: F.gelu(x, approximate="tanh"))
    x, delta = torch.randn(5, 48), torch.randn(5, 48)
    with torch.inference_mode():
        plain = (norm.add_and_norm(x, delta), mlp(x), norm(x))
        model = torch.nn.ModuleList([norm, mlp, geglu, Attention(0, 48, 4, 2, 12)])
        assert cpu_kernels.attach_layer_ops(model, kernels) == 3  # norm, SiLU MLP, attention
        assert geglu.cpu_ops is None and mlp.cpu_ops is kernels
        fused = (norm.add_and_norm(x, delta), mlp(x), norm(x))
    torch.testing.assert_close(fused[0][0], plain[0][0], rtol=0, atol=0)
    torch.testing.assert_close(fused[0][1], plain[0][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[2], plain[2], rtol=1e-5, atol=1e-5)
    assert cpu_kernels.attach_layer_ops(model, None) == 3 and mlp.cpu_ops is None
