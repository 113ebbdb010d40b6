"""Roofline step-time model of a decoder-only transformer on one simulated accelerator.

    step time = overhead + max(bytes / (bandwidth * eff_bw), flops / (peak_flops * eff_compute))
              + swapped bytes / host link bandwidth

bytes = weights read once per step + every scheduled request's KV context read + new KV written;
flops = 2 * linear params * tokens + 2 * lm_head params * sampled rows + attention
        (4 * layers * heads * head_dim per query-key pair, causal within a chunk).

A Mixture-of-Experts model (`expert_params` > 0): each token runs top_k of E experts per
layer, so the experts add 2 * expert params * top_k / E FLOPs per token (the active
parameters); a step reads the dense weights plus the experts its tokens are routed to, which
under uniform routing is the expected fraction 1 - (1 - top_k / E)^tokens of the experts
(one decode token reads top_k / E of them, a long prefill all of them).
`num_devices` > 1 models ideal tensor parallelism (bandwidth, compute and memory add up;
the all-reduce is not modelled). See docs/sim.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from worker_service.model_config import ModelConfig
from worker_service.models import family
from worker_service.sim.profiles import AcceleratorProfile

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"sim dtype {dtype!r} unknown; known: {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelGeometry:
    """The sizes the cost model needs: the model family's counts (`ModelFamily.counts`, summed
    from its declared parameters) and the dtype's bytes."""

    num_layers: int
    num_heads: int  # query heads (attention FLOPs)
    num_kv_heads: int
    head_dim: int
    linear_params: int  # matmul weights applied to every token, all layers
    lm_head_params: int  # applied to the sampled rows
    lookup_params: int  # an untied input embedding: only a few rows read per step
    num_parameters: int
    dtype_bytes: int
    expert_params: int = 0  # routed experts' weights, all layers (included in num_parameters)
    num_experts: int = 0
    experts_per_token: int = 0  # top-k

    @property
    def active_params_per_token(self) -> int:
        """Matmul weights one token runs: the dense ones and top_k of E experts per layer."""
        if not self.expert_params:
            return self.linear_params
        return self.linear_params + self.expert_params * self.experts_per_token // self.num_experts

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: str) -> ModelGeometry:
        counts = family(cfg.model_type).counts(cfg)
        return cls(**dataclasses.asdict(counts), dtype_bytes=dtype_bytes(dtype))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in device memory."""
        return self.num_parameters * self.dtype_bytes

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Every matrix is read once per step; of the input embedding only a few rows (an MoE
        model: at most; `weight_bytes_read` counts the experts a step routes to)."""
        return (self.num_parameters - self.lookup_params) * self.dtype_bytes

    def weight_bytes_read(self, tokens: int) -> float:
        """Weights a step of `tokens` tokens reads: all but the experts no token is routed to
        (expected, uniform routing: each expert of a layer is missed by all tokens with
        probability (1 - top_k / E)^tokens)."""
        if not self.expert_params:
            return self.weight_bytes_read_per_step
        touched = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** tokens
        return self.weight_bytes_read_per_step - self.expert_params * (1.0 - touched) * self.dtype_bytes

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
        nbytes = g.weight_bytes_read(tokens) + (context + tokens) * g.kv_bytes_per_token
        flops = (2 * g.active_params_per_token * tokens + 2 * g.lm_head_params * num_sampled
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
