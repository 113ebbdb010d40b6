"""The CPU's packed linear layers (`worker_service/layers/packed_linear.py`): each equals
`F.linear` within float32 rounding at every input shape a step gives it, `pack_linears` swaps
exactly the plain `nn.Linear` modules (a tied head gets its own packed copy, the embedding keeps
its table), and the runner packs by default on CPU and not with `pack_weights=False`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from testing.checkpoints import build_checkpoint
from worker_service.layers.packed_linear import PackedLinear, pack_linears, packing_supported
from worker_service.model_runner import ModelRunner
from worker_service.parallel.layers import RowParallelLinear

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN packed linear")


def _linear(in_features: int, out_features: int, bias: bool, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 64, 300])
def test_packed_linear_equals_f_linear(rows, bias):
    linear = _linear(96, 160, bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)  # [n, in]
    with torch.inference_mode():
        out = packed(x)
    assert out.shape == (rows, 160) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_strided_and_batched_inputs():
    linear = _linear(64, 48, True)
    packed = PackedLinear(linear)
    base = torch.randn(64, 10)
    for x in (base.t(), torch.randn(2, 5, 64), torch.randn(7, 128)[:, ::2]):  # transposed, 3-d, strided
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16), reason="no native bfloat16 here")
def test_packed_linear_bfloat16_matches_f_linear():
    linear = _linear(64, 32, False, torch.bfloat16)
    x = torch.randn(9, 64).to(torch.bfloat16)
    out = PackedLinear(linear)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, linear.weight).float(), rtol=2e-2, atol=2e-2)


def test_packing_is_cpu_float32_or_native_bfloat16_only():
    assert not packing_supported(torch.device("cpu"), torch.float16)
    assert not packing_supported(torch.device("cuda"), torch.float32)
    assert not packing_supported(torch.device("meta"), torch.float32)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)
        self.row = RowParallelLinear(16, 16)  # a tensor-parallel subclass keeps its own forward
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def test_pack_linears_swaps_plain_linears_and_keeps_a_tied_embedding():
    model = _Tied()
    table = model.embed.weight.detach().clone()
    expected = F.linear(torch.ones(2, 16), model.embed.weight)
    assert pack_linears(model) == 2
    assert isinstance(model.proj, PackedLinear) and isinstance(model.head, PackedLinear)
    assert type(model.row) is RowParallelLinear
    assert torch.equal(model.embed.weight, table)  # the embedding still gathers from its table
    torch.testing.assert_close(model.head(torch.ones(2, 16)), expected, rtol=1e-5, atol=1e-5)


def test_runner_packs_by_default_and_not_when_told(tmp_path):
    build_checkpoint(tmp_path, "llama")
    packed = ModelRunner(tmp_path, num_blocks=8, block_size=16)
    plain = ModelRunner(tmp_path, num_blocks=8, block_size=16, pack_weights=False)
    assert packed.packed_linears > 0 and isinstance(packed.model.lm_head, PackedLinear)
    assert plain.packed_linears == 0
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())


def test_packed_linears_compile_as_opaque_ops_and_free_their_weights():
    """Under torch.compile each packed linear is `stepahead::packed_linear` (inductor cannot trace
    the packed tensor): the compiled module equals the eager one at every row count, and the
    op's table of packed weights lets go of a dropped module's."""
    import gc

    from worker_service.layers import packed_linear

    torch.manual_seed(0)
    model = nn.Sequential(PackedLinear(nn.Linear(64, 48)), nn.SiLU(), PackedLinear(nn.Linear(48, 32, bias=False)))
    slots = [int(model[0].slot), int(model[2].slot)]
    compiled = torch.compile(model, dynamic=True)
    with torch.inference_mode():
        for rows in (1, 5, 17):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)
    assert all(s in packed_linear._packed for s in slots)
    del model, compiled
    torch._dynamo.reset()
    gc.collect()
    assert not any(s in packed_linear._packed for s in slots)
