"""Linear layers with their weights packed for the CPU's matmul kernels (oneDNN), as vLLM's
CPU backend and inductor's weight prepacking do.

`F.linear` on a CPU tensor re-reads the row-major weight `[out, in]` through a generic GEMM at
every call, and at a decode step's few rows (n ≤ a few hundred) that GEMM runs far below the
machine's memory bandwidth: the weight is re-blocked on the fly, once per call. oneDNN's
packed layout is blocked once, at load time, for its AVX-512 / AMX micro-kernels; the same
matmul then reads each weight byte once per call. `benchmarks/forward.py --unpacked` measures
the step with and without it.

The results are the same matmul summed in another order: equal to `F.linear` within float32
rounding, not bit for bit (the Hugging Face oracle's tie rule covers the near-ties this can
flip). Only exact `nn.Linear` modules are packed: the tensor-parallel subclasses
(`parallel/layers.py`) keep their own forward, and a tied head gets a packed copy while the
embedding keeps the table it gathers from.

Under `torch.compile` (`--no-enforce-eager`) each packed linear is one opaque op,
`stepahead::packed_linear`, naming its weight by slot in this process's table of packed
weights (inductor cannot trace the packed tensor itself): the norms, rotary and activations
between the matmuls compile and fuse, the matmuls run on the packed weights. The slot is a 0-d
host tensor, a graph input, not an int constant: the decoder layers, identical but for their
weights, share one compiled graph (`worker_service/compiled.py`).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear exists for this device and weight dtype (bfloat16 only on a CPU
    with native bfloat16 dot products)."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False  # a torch build without the ops inductor packs with
    return dtype == torch.float32 or bool(ops._is_mkldnn_bf16_supported())


# every live PackedLinear's packed weight by slot, the compiled op's handle on it (weak: a
# dropped model's weights go with it)
_packed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_slots = itertools.count()


class PackedLinear(nn.Module):
    """`y = x W^T + b` with `W` in oneDNN's blocked layout: an opaque tensor, not a parameter."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()  # [out, in]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)  # [out, in], mkldnn layout
        self.bias = None if linear.bias is None else linear.bias.detach()  # [out]
        slot = next(_slots)
        _packed[slot] = self.packed
        self.slot = torch.tensor(slot, dtype=torch.int64, device="cpu")  # a plain attribute: stays on the host

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if torch.compiler.is_compiling():
            return torch.ops.stepahead.packed_linear(x, self.bias, self.slot, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("stepahead::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, bias: torch.Tensor | None, slot: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _packed[int(slot)], bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x, bias, slot, out_features):
    return x.new_empty((*x.shape[:-1], out_features))  # [..., out]


def pack_linears(model: nn.Module) -> int:
    """Swap every exact `nn.Linear` of `model` for a `PackedLinear`; returns how many. The
    unpacked weights are released (a tied head's stays, as the embedding's table)."""
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, PackedLinear(getattr(owner, attr)))
    return len(names)
