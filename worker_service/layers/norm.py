"""Normalisations over the last dim, rounded as Hugging Face's modules round them."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.cpu_kernels import layer_ops


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim `[..., dim]` -> `[..., dim]`.

    HF Llama's rounding: normalise in float32, cast back to x's dtype, then scale by the weight;
    `scale_in_float32` (OLMo 2's): scale the float32 values, then cast.
    `worker_service/parallel/layers.py` ShardedRMSNorm follows the same flag on a split width.
    """

    cpu_ops: ModuleType | None = None  # the CPU layer kernels, where the runner attached them (cpu_kernels.py)

    def __init__(self, dim: int, eps: float, *, scale_in_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # [dim]
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            ops = layer_ops(self, x)
            if ops is not None and x.dim() == 2:
                return ops.rms_norm(x, self.weight, self.eps)  # one pass
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)  # same math, fewer ops
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # [..., dim] float32
        if self.scale_in_float32:
            return (self.weight * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and this pre-norm after it: `(x + delta, norm(x + delta))`, x and delta
        `[n, dim]`; one pass with the CPU layer kernels."""
        ops = layer_ops(self, x)
        if ops is not None and self.weight.dtype == torch.float32 and x.dim() == 2:
            total, normed = ops.add_rms_norm(x, delta, self.weight, self.eps)
            return total, normed
        x = x + delta
        return x, self(x)

    def accepts_cpu_ops(self) -> bool:
        return True


class OffsetRMSNorm(nn.Module):
    """HF's Gemma RMSNorm: x / rms(x) * (1 + weight), both in float32, then cast;
    `[..., dim]` -> `[..., dim]`. The weight starts at zero, the identity scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # [dim]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # [..., dim] float32
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and bias `[dim]`) over the last dim `[..., dim]` -> `[..., dim]`."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps=eps)
