"""Feed-forward blocks: the gated MLP (gate and up fused in one matmul) and the plain one."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu (Llama), GeGLU with gelu_pytorch_tanh (Gemma).
    HF's gate_proj and up_proj are fused into `gate_up_proj` (the family's declarations fill it)."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.intermediate, self.act = intermediate, act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)  # weight: [2 * inter, hidden]
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)  # weight: [hidden, inter]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [n, inter] each
        return self.down_proj(self.act(gate) * up)  # [n, hidden]


class MLP(nn.Module):
    """c_proj(act(c_fc(x))), biases on both (GPT-2's names, HF's `Conv1D` held as `nn.Linear`)."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.c_fc = nn.Linear(hidden, intermediate)  # weight: [inter, hidden], bias: [inter]
        self.c_proj = nn.Linear(intermediate, hidden)  # weight: [hidden, inter], bias: [hidden]
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # [n, hidden] -> [n, inter] -> [n, hidden]
