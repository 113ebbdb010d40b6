"""Scheduler core configuration (pure Python): the scheduling knobs and the pool's geometry."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from stepahead import config as cfg
from stepahead.knobs import DEFAULT_BLOCK_SIZE, StepBudgetConfig
from stepahead.logprobs import MAX_LOGPROBS
from stepahead.plan import WorkerRole
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
class SchedulingConfig(StepBudgetConfig):
    """The scheduling knobs, declared once: the scheduler daemon's flags (it composes this
    group) and the core's settings (`SchedulerConfig` adds the geometry a worker announces)."""

    enable_chunked_prefill: bool = cfg.field(True, "split long prompts across steps")
    long_prefill_token_threshold: int = cfg.field(0, "cap per-request prefill tokens per step (0 = off)")
    enable_prefix_caching: bool = cfg.field(True, "reuse KV blocks of identical prompt prefixes")
    scheduling_policy: SchedulingPolicy = cfg.field(SchedulingPolicy.FCFS, "queue policy")
    preemption_mode: PreemptionMode = cfg.field(PreemptionMode.RECOMPUTE, "what preemption does to KV")
    async_scheduling: bool = cfg.field(True, "plan step t+1 while step t runs")
    max_concurrent_batches: int = cfg.field(
        3, "plans in flight at most in async mode (with --adaptive-concurrent-batches: while the device waits "
           "for plans; else always)")
    adaptive_concurrent_batches: bool = cfg.field(
        True, "plan one step ahead, and further (up to --max-concurrent-batches) only while the device waits "
              "for its plans: a deeper window costs new requests a step of TTFT (docs/architecture.md)")
    max_queued_requests: int | None = cfg.field(
        4096, "waiting requests at most; more are refused with RESOURCE_EXHAUSTED (SGLang's name; None: unbounded)")
    max_expected_wait: float | None = cfg.field(
        None, "admission control, seconds (unset: off): a new request whose expected queue wait (the requests the "
              "policy serves before it over the measured admission rate) is longer is refused with "
              "RESOURCE_EXHAUSTED / HTTP 429, so under overload the lowest priority class is shed first; with it on, "
              "the score policy also sheds a request not admitted within --max-wait-time (instead of aging it)")
    preemption_min_progress: int = cfg.field(
        16, "output tokens a preempted request commits before it may be preempted again (0: no protection; "
            "scheduler_service/core/preemption.py)")
    # score policy: priority first; within a priority, score = w_length * remaining tokens - w_wait * seconds
    # waited, lowest first (scheduler_service/core/policy.py)
    score_wait_weight: float = cfg.field(1.0, "score policy: weight of seconds waited (subtracted)")
    score_length_weight: float = cfg.field(0.005, "score policy: weight of remaining tokens")
    max_wait_time: float = cfg.field(
        30.0, "score policy: seconds after which a request is admitted first (it jumps ahead of every younger "
              "request and may preempt running work that has not aged; inf: no aging); with --max-expected-wait, "
              "a request with no token yet is shed then instead")
    score_ttft_target: float = cfg.field(
        0.0, "score policy: TTFT target in s (0: off): within a priority, a request with no token yet past "
                   "half of it goes first, and one past it after those that can still meet it")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulingConfig):
    """Everything the scheduler core needs: the scheduling knobs, and the geometry that comes
    from the worker's hello."""

    num_gpu_blocks: int
    max_model_len: int
    block_size: int = DEFAULT_BLOCK_SIZE
    num_cpu_blocks: int = 0
    num_speculative_tokens: int = 0  # K of n-gram speculation (0: off): K+1 tokens budgeted per decode
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # token ids in submissions and results are checked against it
    max_logprobs: int = MAX_LOGPROBS  # the worker's --max-logprobs (from its hello)
    # the window every attention layer applies (the hello's; 0: some layer sees everything):
    # a request's leading blocks that every layer slid past are freed (`KVCacheManager.release_slid`)
    sliding_window: int = 0
    # host blocks set aside for the prefix cache's host tier (the hello's; 0: off): evicted cached
    # blocks are offloaded there and loaded back on a hit (`KVCacheManager`; needs prefix caching)
    num_offload_blocks: int = 0
    # the replica's part in disaggregated prefill/decode (the hello's `role`): a PREFILL core
    # hands each request off after its first token (`Scheduler.take_handoffs`)
    role: WorkerRole = WorkerRole.BOTH
    # the worker compiles grammars beside the steps (the hello's `prepares_grammars`): a
    # structured request waits PREPARING until its worker reports the grammar (`grammar_ready`)
    prepare_grammars: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
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
        if self.max_expected_wait is not None and not self.max_expected_wait > 0:  # also refuses NaN
            raise ValueError(f"max_expected_wait must be > 0, got {self.max_expected_wait}")
        if self.preemption_min_progress < 0:
            raise ValueError(f"preemption_min_progress must be >= 0, got {self.preemption_min_progress}")
        if not self.score_ttft_target >= 0:  # also refuses NaN
            raise ValueError(f"score_ttft_target must be >= 0, got {self.score_ttft_target}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def max_in_flight(self) -> int:
        """Plans allowed in flight at once: 1 in synchronous mode."""
        return self.max_concurrent_batches if self.async_scheduling else 1
