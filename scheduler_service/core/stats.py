"""Scheduler counters and gauges (field names match the SchedulerStats proto)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

from scheduler_service.core.kv_manager import KVCacheManager
from stepahead.plan import StepResult


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
    device_busy_s: float  # sum of the committed results' WorkerTiming.device_busy_s
    num_sampled_tokens: int  # tokens the device sampled so far (stale ones included)
    spec_num_draft_tokens: int = 0  # speculative decoding: drafts proposed and verified
    spec_num_accepted_tokens: int = 0  # ... and accepted
    num_slid_blocks: int = 0  # KV blocks freed because every layer's sliding window had passed them
    prefix_host_hit_tokens: int = 0  # host tier: prompt tokens loaded from host blocks on a hit
    num_offloaded_blocks: int = 0  # ... evicted device blocks copied to host blocks
    num_host_evictions: int = 0  # ... cached host blocks dropped for room
    num_handoffs: int = 0  # disaggregation: requests a prefill core handed off
    num_loaded_blocks: int = 0  # ... KV blocks a decode core loaded from a prefill replica
    num_failed_loads: int = 0  # ... loads that failed (computed again instead)
    num_loading: int = 0  # ... requests holding blocks while their KV loads (a gauge)


def build_stats(kv: KVCacheManager, counts: Counter, num_running: int, num_waiting: int, num_swapped: int,
                num_in_flight: int, num_loading: int = 0) -> SchedulerStats:
    device, host = kv.device, kv.host
    return SchedulerStats(
        num_running=num_running,
        num_waiting=num_waiting,
        num_swapped=num_swapped,
        num_total_blocks=device.num_blocks,
        num_free_blocks=device.num_free,
        num_cached_blocks=device.num_cached,
        num_fenced_blocks=device.num_fenced,
        kv_usage=device.num_used / device.num_blocks,
        num_used_host_blocks=host.num_used + host.num_fenced,
        prefix_query_tokens=counts["prefix_query_tokens"],
        prefix_hit_tokens=counts["prefix_hit_tokens"],
        num_preemptions=counts["num_preemptions"],
        num_swap_outs=counts["num_swap_outs"],
        num_steps=counts["num_steps"],
        num_finished=counts["num_finished"],
        num_aborted=counts["num_aborted"],
        num_in_flight=num_in_flight,
        device_busy_s=counts["device_busy_s"],
        num_sampled_tokens=counts["num_sampled_tokens"],
        spec_num_draft_tokens=counts["spec_num_draft_tokens"],
        spec_num_accepted_tokens=counts["spec_num_accepted_tokens"],
        num_slid_blocks=counts["num_slid_blocks"],
        prefix_host_hit_tokens=counts["prefix_host_hit_tokens"],
        num_offloaded_blocks=counts["num_offloaded_blocks"],
        num_host_evictions=counts["num_host_evictions"],
        num_handoffs=counts["num_handoffs"],
        num_loaded_blocks=counts["num_loaded_blocks"],
        num_failed_loads=counts["num_failed_loads"],
        num_loading=num_loading,
    )


def count_result(counts: Counter, result: StepResult) -> None:
    """A committed step result's share of the monotonic counters."""
    counts["num_steps"] += 1
    counts["device_busy_s"] += result.timing.device_busy_s
    counts["num_sampled_tokens"] += len(result.sampled_token_ids)
    for outcome in result.speculation.values():
        counts["spec_num_draft_tokens"] += outcome.num_draft_tokens
        counts["spec_num_accepted_tokens"] += len(outcome.accepted_token_ids)


def sum_stats(stats: list[SchedulerStats], carried: Counter | None = None) -> SchedulerStats | None:
    """Replicas' stats added up (kv_usage recomputed over all blocks), plus the `carried`
    monotonic counters of replicas that are gone; None for no replica."""
    if not stats:
        return None
    total = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(SchedulerStats)}
    for name, value in (carried or {}).items():
        if name in total:
            total[name] += value
    used = sum(s.kv_usage * s.num_total_blocks for s in stats)
    total["kv_usage"] = used / total["num_total_blocks"]
    return SchedulerStats(**total)
