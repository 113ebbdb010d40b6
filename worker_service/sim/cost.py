"""Roofline step-time model of a decoder-only transformer on one simulated accelerator.

    step time = overhead + max(bytes / (bandwidth * eff_bw), flops / (peak_flops * eff_compute))
              + swapped bytes / host link bandwidth

bytes = weights read once per step + every scheduled request's KV context read + new KV written;
flops = 2 * linear params * tokens + 2 * lm_head params * sampled rows + attention
        (4 * layers * heads * head_dim per query-key pair, causal within a chunk).
`num_devices` > 1 models ideal tensor parallelism (bandwidth, compute and memory add up;
the all-reduce is not modelled). See docs/sim.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_service.model_config import ModelConfig
from worker_service.sim.profiles import AcceleratorProfile

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"sim dtype {dtype!r} unknown; known: {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelGeometry:
    """The sizes the cost model needs, from a checkpoint's config.json."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype_bytes: int

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: str) -> ModelGeometry:
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings, dtype_bytes(dtype))

    @property
    def layer_linear_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * q + 2 * self.hidden_size * kv + q * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        norms = (2 * self.num_layers + 1) * self.hidden_size
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_linear_params + embeddings + norms

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in device memory."""
        return self.num_parameters * self.dtype_bytes

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Every matrix is read once per step; of the input embedding only a few rows."""
        untied_embedding = 0 if self.tie_word_embeddings else self.lm_head_params
        return (self.num_parameters - untied_embedding) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class StepCost:
    seconds: float  # the whole step: overhead + roofline + swap
    bytes: float
    flops: float
    memory_bound: bool


class CostModel:
    def __init__(self, geometry: ModelGeometry, profile: AcceleratorProfile, num_devices: int = 1) -> None:
        if num_devices < 1:
            raise ValueError(f"sim num_devices must be >= 1, got {num_devices}")
        self.geometry, self.profile, self.num_devices = geometry, profile, num_devices
        self._bandwidth = profile.memory_bandwidth * profile.bandwidth_efficiency * num_devices
        self._flops = profile.peak_flops * profile.compute_efficiency * num_devices
        self._host_link = profile.host_link_bandwidth * num_devices
        g = geometry
        self._attn_flops_per_pair = 4 * g.num_layers * g.num_heads * g.head_dim

    def step(self, batch: list[tuple[int, int]], num_sampled: int, swapped_blocks: int = 0,
             block_size: int = 16) -> StepCost:
        """batch: (tokens already in the KV cache, tokens computed now) per scheduled request."""
        tokens = context = pairs = 0
        for computed, scheduled in batch:
            tokens += scheduled
            context += computed + scheduled
            pairs += scheduled * computed + scheduled * (scheduled + 1) // 2  # causal
        return self.step_totals(tokens, context, pairs, num_sampled, swapped_blocks, block_size)

    def step_totals(self, tokens: int, context: int, pairs: int, num_sampled: int, swapped_blocks: int = 0,
                    block_size: int = 16) -> StepCost:
        """`step` from the batch's sums: tokens computed, context (Σ computed + scheduled) and
        causal attention pairs (Σ scheduled·computed + scheduled·(scheduled+1)/2)."""
        g = self.geometry
        nbytes = g.weight_bytes_read_per_step + (context + tokens) * g.kv_bytes_per_token
        flops = (2 * g.num_layers * g.layer_linear_params * tokens + 2 * g.lm_head_params * num_sampled
                 + self._attn_flops_per_pair * pairs)
        memory_s, compute_s = nbytes / self._bandwidth, flops / self._flops
        swap_s = swapped_blocks * block_size * g.kv_bytes_per_token / self._host_link
        seconds = self.profile.step_overhead_s + max(memory_s, compute_s) + swap_s
        return StepCost(seconds, nbytes, flops, memory_s >= compute_s)

    def num_kv_blocks(self, block_size: int, memory_utilization: float, reserve_bytes: float = 2 * 2**30) -> int:
        """Device KV blocks: memory * utilization - weights - an activation reserve."""
        memory = self.profile.memory_bytes * self.num_devices * memory_utilization
        free = memory - self.geometry.weight_bytes - reserve_bytes * self.num_devices
        blocks = int(free // (block_size * self.geometry.kv_bytes_per_token))
        if blocks < 1:
            raise ValueError(
                f"weights of {self.geometry.weight_bytes / 1e9:.1f} GB leave no KV memory on "
                f"{self.num_devices} x {self.profile.name} ({self.profile.memory_bytes / 1e9:.0f} GB each, "
                f"utilization {memory_utilization}); use more devices (--sim-num-devices) or a smaller dtype")
        return blocks
