"""The flag groups more than one process declares, each knob once with one default.

A daemon's config composes the groups it needs (frozen dataclasses, inherited: the fields
stay flat, `config.max_num_seqs`, and every field is still the flag `--max-num-seqs`):

    StepBudgetConfig     scheduler (its step budget), worker (buffers sized and profiled for it)
    SpeculativeFlag      scheduler (K: tokens budgeted per decode), worker (the lookup window)
    KVCacheConfig        worker, simulator (the KV pool's geometry and size)
    SimDeviceConfig      worker --device sim, simulator (the simulated accelerator)

`stepahead serve` declares the same groups once and hands each daemon its share
(`fields_of`), so no knob is listed by name twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stepahead import config as cfg

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block: the worker announces it, the scheduler core takes it


def fields_of(*groups: type) -> tuple[str, ...]:
    """The field (flag) names of config groups, in declaration order."""
    return tuple(f.name for group in groups for f in dataclasses.fields(group))


@dataclass(frozen=True)
class StepBudgetConfig:
    max_num_seqs: int = cfg.field(
        256, "requests per step at most (the scheduler's budget; the worker sizes and profiles its step buffers "
             "for it)")
    max_num_batched_tokens: int = cfg.field(
        2048, "tokens per step at most (the scheduler's budget; the worker sizes and profiles its step buffers "
              "for it)")


@dataclass(frozen=True)
class SpeculativeFlag:
    speculative_config: str | None = cfg.field(
        None, "n-gram speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": K, "
              "\"prompt_lookup_min\": a, \"prompt_lookup_max\": b}' (docs/speculative-decoding.md)")


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = cfg.field(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    gpu_memory_utilization: float = cfg.field(
        0.9, "fraction of the accelerator's memory this worker may use; the KV cache gets what the weights and a "
             "profiling step at max_num_seqs / max_num_batched_tokens leave of it")
    num_gpu_blocks_override: int | None = cfg.field(None, "exact number of device KV blocks")
    swap_space: float = cfg.field(1.0, "host memory for swapped-out KV blocks, GiB")
    kv_offloading_size: float = cfg.field(
        0.0, "host memory for the prefix cache's second tier, GiB (vLLM's name; 0: off): committed blocks evicted "
             "from the device are copied to host memory and loaded back on a prefix hit instead of recomputed; "
             "the host pool is --swap-space plus this, shared with swapping")

    def host_blocks(self, block_bytes: int) -> tuple[int, int]:
        """(the host pool's blocks, the share --kv-offloading-size added) at `block_bytes` a block."""
        offload = int(self.kv_offloading_size * 2**30) // block_bytes
        return int(self.swap_space * 2**30) // block_bytes + offload, offload


@dataclass(frozen=True)
class SimDeviceConfig:
    sim_profile: str = cfg.field("h100", "--device sim: accelerator profile h100, h200, a100 or a JSON file")
    sim_num_devices: int = cfg.field(1, "--device sim: accelerators per replica (ideal tensor parallelism)")
