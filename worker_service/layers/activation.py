"""The MLP activations, by their config.json names, op for op as transformers' ACT2FN computes
them (each `[...]` -> `[...]`). A family's spec lists the names it accepts (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation, op for op (GPT-2's `gelu_new`)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """`gelu_pytorch_tanh` (Gemma's GeGLU, GPT-2 variants)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
}
