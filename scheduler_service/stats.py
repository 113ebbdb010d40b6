"""Scheduler counters and gauges (field names match the SchedulerStats proto)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_total_blocks: int
    num_free_blocks: int  # free or cached-and-evictable
    num_cached_blocks: int  # carrying a prefix-cache entry (in use or not)
    num_fenced_blocks: int
    kv_usage: float
    num_used_host_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_swap_outs: int
    num_steps: int
    num_finished: int
    num_aborted: int
    num_in_flight: int
