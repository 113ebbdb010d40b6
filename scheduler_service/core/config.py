"""Scheduler core configuration (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from stepahead.logprobs import MAX_LOGPROBS
from stepahead.speculative import MAX_SPECULATIVE_TOKENS


class SchedulingPolicy(str, Enum):
    """Which request the scheduler serves first."""

    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # lower priority value first, ties by arrival; may preempt worse
    SCORE = "score"  # weighted score of priority, wait time and remaining length, with aging


class PreemptionMode(str, Enum):
    """What happens to a preempted request's KV cache."""

    RECOMPUTE = "recompute"  # drop the KV; re-prefill prompt + committed output later
    SWAP = "swap"  # copy the KV blocks to the host pool; copy them back before new admissions


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduler core needs; the geometry comes from the worker's hello."""

    num_gpu_blocks: int
    max_model_len: int
    block_size: int = 16
    num_cpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = off; otherwise max tokens per request per step
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    async_scheduling: bool = True
    max_concurrent_batches: int = 2
    # one step ahead, and up to max_concurrent_batches only while the device waits for plans
    # (`window.AdaptiveWindow`; the engine's StepLoop and the offline simulator apply it)
    adaptive_concurrent_batches: bool = False
    num_speculative_tokens: int = 0  # K of n-gram speculation (0: off): K+1 tokens budgeted per decode
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # token ids in submissions and results are checked against it
    max_logprobs: int = MAX_LOGPROBS  # the worker's --max-logprobs (from its hello)
    max_queued_requests: int | None = None  # waiting requests at most; None = unbounded
    # score policy: score = w_priority * priority + w_length * remaining tokens
    #                       - w_wait * seconds waited; lowest score first.
    score_priority_weight: float = 10.0  # seconds of waiting one priority level is worth (w_wait = 1)
    score_wait_weight: float = 1.0
    score_length_weight: float = 0.005
    # score policy: a request waiting longer than this (clock units) jumps ahead of every
    # younger request and may preempt running work that has not aged. inf disables aging.
    max_wait_time: float = 30.0
    # score policy: TTFT target (clock units; 0 = off). A request with no token yet that has
    # waited past half of it, but not past it, is urgent: its length term no longer counts.
    score_ttft_target: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}) so that any prompt fits one step"
            )
        if not isinstance(self.scheduling_policy, SchedulingPolicy):
            object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        if not isinstance(self.preemption_mode, PreemptionMode):
            object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        if self.max_wait_time <= 0 or math.isnan(self.max_wait_time):
            raise ValueError(f"max_wait_time must be > 0, got {self.max_wait_time}")
        if not self.score_ttft_target >= 0:  # also refuses NaN
            raise ValueError(f"score_ttft_target must be >= 0, got {self.score_ttft_target}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def max_in_flight(self) -> int:
        """Plans allowed in flight at once: 1 in synchronous mode."""
        return self.max_concurrent_batches if self.async_scheduling else 1
