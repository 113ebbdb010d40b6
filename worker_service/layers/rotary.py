"""Rotary position embeddings: a cos/sin table computed once, gathered by position per step.

The inverse frequencies of each `rope_type` are computed as Hugging Face's `ROPE_INIT_FUNCTIONS`
compute them (`transformers/modeling_rope_utils.py`), over the rotated leading `rotary_dim` of
each head (`RopeConfig.partial_rotary_factor`), with the attention factor (yarn, longrope) on
cos and sin.

Two types depend in HF on the length of the sequence (`dynamic_rope_update`): HF recomputes the
frequencies of every position of a forward from its largest position. A paged KV cache holds
keys rotated once, so here each position has one rotation, fixed (`angles`):

- longrope: positions below `original_max_position_embeddings` by `short_factor`, those at or
  past it by `long_factor`;
- dynamic: position p by the base HF computes for a sequence of p + 1 tokens (the plain base up
  to `original_max_position_embeddings`, which is config.json's max_position_embeddings).

That is what HF's `generate` does to a prompt no longer than that length and to every token
generated after it (each decode step's one position is its largest), so the two agree there.
A prompt longer than it HF rotates whole by the long factors (longrope) or by the base of its
full length (dynamic); here its positions below the length keep the short / plain rotation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from worker_service.model_config import RopeConfig


def _exponents(dim: int) -> torch.Tensor:
    """`[dim // 2]` float32: 2i / dim, the exponent of the base for frequency i."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(rope: RopeConfig, dim: int) -> torch.Tensor:
    return 1.0 / (rope.theta ** _exponents(dim))


def _linear(rope: RopeConfig, dim: int) -> torch.Tensor:
    return _default(rope, dim) / rope.factor


def _dynamic(rope: RopeConfig, dim: int) -> torch.Tensor:
    # the frequencies of a sequence no longer than the trained length: HF's base unchanged
    return _dynamic_at(rope, dim, torch.tensor([rope.original_max_position_embeddings]))[0]


def _dynamic_at(rope: RopeConfig, dim: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """`[len(seq_lens), dim // 2]`: dynamic NTK's frequencies for sequences of `seq_lens` tokens
    (int64, each at least the trained length), as HF computes them for one."""
    trained = rope.original_max_position_embeddings
    base = rope.theta * ((rope.factor * seq_lens / trained) - (rope.factor - 1)) ** (dim / (dim - 2))  # [rows]
    return 1.0 / (base[:, None] ** _exponents(dim)[None, :])


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    trained = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dim completing `rotations` turns in the trained length
        return (dim * math.log(trained / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [dim/2]
    extrapolated = 1 - ramp  # 1: the frequency kept, 0: divided by factor
    pos_freqs = rope.theta ** _exponents(dim)
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def _longrope_with(rope: RopeConfig, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** _exponents(dim))


def _longrope(rope: RopeConfig, dim: int) -> torch.Tensor:
    # a sequence within the trained length: the short factors (HF's table at init)
    return _longrope_with(rope, dim, rope.short_factor)


def _llama3(rope: RopeConfig, dim: int) -> torch.Tensor:
    freq = _default(rope, dim)
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# rope_type -> the inverse frequencies `[rotary_dim // 2]` float32 of a sequence within the trained length
INV_FREQ: dict[str, Callable[[RopeConfig, int], torch.Tensor]] = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "longrope": _longrope,
    "llama3": _llama3,
}


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies `[rotary_dim // 2]` float32, computed exactly as Hugging Face does (for a
    sequence within the trained length; `angles` has the per-position ones)."""
    return INV_FREQ[rope.rope_type](rope, rope.rotary_dim(head_dim))


def _yarn_scaling(rope: RopeConfig) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def _longrope_scaling(rope: RopeConfig) -> float:
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


# rope_type -> the cos/sin factor HF derives when config.json gives no attention_factor (others: 1)
ATTENTION_SCALING: dict[str, Callable[[RopeConfig], float]] = {"yarn": _yarn_scaling, "longrope": _longrope_scaling}


def attention_scaling(rope: RopeConfig) -> float:
    """The factor HF multiplies cos and sin by (yarn's mscale, longrope's; 1 for the others)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    derive = ATTENTION_SCALING.get(rope.rope_type)
    return derive(rope) if derive is not None else 1.0


def _longrope_past(rope: RopeConfig, dim: int, positions: torch.Tensor) -> torch.Tensor:
    return _longrope_with(rope, dim, rope.long_factor)[None, :].expand(len(positions), -1)


def _dynamic_past(rope: RopeConfig, dim: int, positions: torch.Tensor) -> torch.Tensor:
    return _dynamic_at(rope, dim, positions + 1)  # position p: a sequence of p + 1 tokens


# rope_type -> `[len(positions), rotary_dim // 2]`: the frequencies of positions at or past the
# trained length, for the types whose HF frequencies depend on the sequence length
PAST_TRAINED: dict[str, Callable[[RopeConfig, int, torch.Tensor], torch.Tensor]] = {
    "longrope": _longrope_past, "dynamic": _dynamic_past,
}


def angles(rope: RopeConfig, head_dim: int, max_len: int) -> torch.Tensor:
    """`[max_len, rotary_dim // 2]` float32: position times inverse frequency, each position by
    its own fixed rule (the module docstring: longrope and dynamic past the trained length)."""
    positions = torch.arange(max_len, dtype=torch.float32)  # [max_len]
    freq = inv_freq(rope, head_dim)[None, :].expand(max_len, -1)  # [max_len, rotary_dim/2]
    trained = rope.original_max_position_embeddings
    past = PAST_TRAINED.get(rope.rope_type)
    if past is not None and max_len > trained:
        later = past(rope, rope.rotary_dim(head_dim), torch.arange(trained, max_len))  # [max_len - trained, dim/2]
        freq = torch.cat((freq[:trained], later))
    return positions[:, None] * freq


class RotaryTable:
    """cos and signed sin for every position below `max_len`, in the model dtype, on the device,
    `[max_len, rotary_dim]` (`rotary_dim` < head_dim: partial rotary, the rest of a head passes).

    `sin` has its first half negated (`[-sin, sin]`), so that the rotate-half term of HF Llama,
    `cat(-x2, x1) * sin`, becomes `roll(x, half) * sin`: one op instead of a slice, a
    negation and a concatenation per layer. Both carry the attention factor (yarn, longrope).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        angle = angles(rope, head_dim, max_len)  # [max_len, rotary_dim/2]
        emb = torch.cat((angle, angle), dim=-1)  # [max_len, rotary_dim]
        dim = emb.shape[-1]
        half = dim // 2
        sign = torch.cat((torch.full((half,), -1.0), torch.ones(dim - half)))  # [rotary_dim]
        scale = attention_scaling(rope)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale * sign).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin `[num_tokens, 1, rotary_dim]` for `positions` `[num_tokens]`."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[num_tokens, heads, head_dim]` rotated by the rotate-half convention of HF Llama over
    its first `rotary_dim` = cos.shape[-1] dims; the rest of each head unchanged (partial rotary).

    `sin` is `RotaryTable`'s signed sin (first half negated): `x*cos + cat(-x2, x1)*sin_hf`.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        rolled = x.roll(rotary_dim // 2, dims=-1)  # [n, heads, d]: cat(x2, x1)
        return torch.addcmul(x * cos, rolled, sin)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]  # [n, heads, rotary_dim], [n, heads, d - rotary_dim]
    rolled = rot.roll(rotary_dim // 2, dims=-1)
    return torch.cat((torch.addcmul(rot * cos, rolled, sin), rest), dim=-1)
