"""Rotary position embeddings: a cos/sin table computed once, gathered by position per step."""

from __future__ import annotations

import math

import torch

from worker_service.model_config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32, computed exactly as Hugging Face does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos and signed sin for every position below `max_len`, in the model dtype, on the device.

    `sin` has its first half negated (`[-sin, sin]`), so that the rotate-half term of HF Llama,
    `cat(-x2, x1) * sin`, becomes `roll(x, half) * sin`: one op instead of a slice, a
    negation and a concatenation per layer.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        freq = inv_freq(rope, head_dim)  # [head_dim/2]
        positions = torch.arange(max_len, dtype=torch.float32)
        angles = positions[:, None] * freq[None, :]  # [max_len, head_dim/2]
        emb = torch.cat((angles, angles), dim=-1)  # [max_len, head_dim]
        half = head_dim // 2
        sign = torch.cat((torch.full((half,), -1.0), torch.ones(head_dim - half)))  # [head_dim]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = (emb.sin() * sign).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin `[num_tokens, 1, head_dim]` for `positions` `[num_tokens]`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[num_tokens, heads, head_dim]` rotated by the rotate-half convention of HF Llama.

    `sin` is `RotaryTable`'s signed sin (first half negated): `x*cos + cat(-x2, x1)*sin_hf`.
    """
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # [n, heads, d]: cat(x2, x1)
    return torch.addcmul(x * cos, rolled, sin)
