"""Feed-forward blocks: the gated MLP (gate and up fused in one matmul) and the plain one."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.cpu_kernels import layer_ops


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu (Llama), GeGLU with gelu_pytorch_tanh (Gemma).
    HF's gate_proj and up_proj are fused into `gate_up_proj` (the family's declarations fill it)."""

    cpu_ops: ModuleType | None = None  # the CPU layer kernels, where the runner attached them (cpu_kernels.py)

    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.intermediate, self.act = intermediate, act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)  # weight: [2 * inter, hidden]
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)  # weight: [hidden, inter]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden]
        gate_up = self.gate_up_proj(x)  # [n, 2 * inter]
        ops = layer_ops(self, gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.shape[1] == 2 * self.intermediate:
            return self.down_proj(ops.silu_and_mul(gate_up))  # SwiGLU in one pass (accepts_cpu_ops: silu)
        gate, up = gate_up.split(self.intermediate, dim=-1)  # [n, inter] each
        return self.down_proj(self.act(gate) * up)  # [n, hidden]

    def accepts_cpu_ops(self) -> bool:
        return self.act is F.silu


class MLP(nn.Module):
    """c_proj(act(c_fc(x))), biases on both (GPT-2's names, HF's `Conv1D` held as `nn.Linear`)."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.c_fc = nn.Linear(hidden, intermediate)  # weight: [inter, hidden], bias: [inter]
        self.c_proj = nn.Linear(intermediate, hidden)  # weight: [hidden, inter], bias: [hidden]
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # [n, hidden] -> [n, inter] -> [n, hidden]
