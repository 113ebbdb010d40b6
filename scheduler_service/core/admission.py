"""What a submission must satisfy before the scheduler core takes it (pure Python).

A gateway is a network peer like any other: every submission is checked against the
shared limits (`stepahead.limits`) again, against the KV pool, against the waiting
queue's bound, and (`ExpectedWait`, when on) against the wait it can expect. The checked request's sampling params are the normalised ones.
"""

from __future__ import annotations

import math
from collections import deque

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.kv_manager import cdiv
from scheduler_service.core.request import QueueFull, Request, RequestRejected
from stepahead import limits

UNCHECKED_VOCAB = 2**62  # a config without vocab_size (core tests) checks ids only for >= 0


def check_submission(config: SchedulerConfig, request: Request, num_waiting: int) -> None:
    """Raises RequestRejected (QueueFull when only the queue is in the way); normalises
    `request.sampling` in place."""
    check_limits(config, request)
    check_fits(config, request)
    bound = config.max_queued_requests
    if bound is not None and num_waiting >= bound:
        raise QueueFull(f"the scheduler's waiting queue is full ({bound} requests, --max-queued-requests); retry later")


def check_limits(config: SchedulerConfig, request: Request) -> None:
    vocab = config.vocab_size if config.vocab_size is not None else UNCHECKED_VOCAB
    model = limits.ModelLimits("", config.max_model_len, vocab)
    try:
        limits.check_id("cache_salt", request.cache_salt or "")  # the id is checked where it is scoped
        limits.check_prompt(request.prompt_token_ids, model)
        limits.check_priority(request.priority)
        # max_tokens past the model's room is runnable: the request ends LENGTH there
        request.sampling = limits.check_sampling(request.sampling, vocab, config.max_logprobs, meta_schema=False)
    except limits.LimitError as exc:
        raise RequestRejected(f"request {request.request_id!r}: {exc}") from None


def check_fits(config: SchedulerConfig, request: Request) -> None:
    """The request at its longest must fit the device pool alone. When every layer is windowed
    it holds only the blocks from its window's first key to what its plans in flight and the
    next one schedule (`KVCacheManager.release_slid`), plus one for the block boundary."""
    n = request.num_prompt_tokens
    final_len = min(n + request.sampling.max_tokens, config.max_model_len)
    blocks = cdiv(final_len - 1, config.block_size)  # the last sampled token is never computed
    if config.sliding_window:
        span = config.sliding_window + config.max_in_flight * config.max_num_batched_tokens
        blocks = min(blocks, cdiv(span, config.block_size) + 1)
    if blocks > config.num_gpu_blocks:
        raise RequestRejected(
            f"request {request.request_id!r}: needs up to {blocks} KV blocks ({final_len} tokens) but the device "
            f"pool has only {config.num_gpu_blocks}"
        )


class ExpectedWait:
    """Admission control (`max_expected_wait`): a new request is refused (QueueFull: the
    gateway answers RESOURCE_EXHAUSTED / HTTP 429 with Retry-After) when its expected queue
    wait is longer than the bound.

        expected wait = requests the policy serves before it / admission rate

    The requests before it are the waiting ones of its priority or better (all of them under
    fcfs: `QueuePolicy.ahead_of`), so under overload the worst class is refused first and a
    better class only once its own backlog is too long. The admission rate is measured while
    the queue is backlogged: over the last `WINDOW` gaps between admissions that had requests
    still waiting (an idle queue's gaps measure the arrivals, not the capacity), the gap open
    since the last admission included, so a core that stops admitting sheds sooner. Before
    any such gap there is no estimate and nothing is refused.

    With admission control on, a request accepted at its arrival may still be passed over
    for longer than the aging bound (`max_wait_time`: later arrivals of better priorities
    take the capacity, as a burst of them may). Such a request is shed when it reaches the
    bound (`overdue`): refused like one at its arrival (QueueFull, retry later), instead of
    aging into an admission that preempts running work. Only a request that has streamed no
    token can be refused; a preempted stream ages and goes first instead."""

    WINDOW = 64

    def __init__(self, bound: float | None, max_wait: float = math.inf) -> None:
        self.bound = bound
        self.max_wait = max_wait
        self._gaps: deque[float] = deque()
        self._sum = 0.0
        self._last: float | None = None
        self._backlogged = False  # requests were still waiting after the last admission

    def admitted(self, now: float, num_waiting: int) -> None:
        """A request left the waiting queue at `now`; `num_waiting` still wait."""
        if self._backlogged and self._last is not None:
            gap = now - self._last
            self._gaps.append(gap)
            self._sum += gap
            if len(self._gaps) > self.WINDOW:
                self._sum -= self._gaps.popleft()
        self._last, self._backlogged = now, num_waiting > 0

    def estimate(self, ahead: int, now: float) -> float | None:
        """Seconds until `ahead` more admissions at the measured rate (None: not measured yet)."""
        if not self._gaps:
            return None
        span = self._sum + (now - self._last if self._backlogged else 0.0)
        return ahead * span / len(self._gaps)

    def overdue(self, request: Request, now: float) -> QueueFull | None:
        """The refusal of a waiting `request` that reached the aging bound with no token, if on."""
        wait = now - request.queued_time
        if self.bound is None or request.num_output_tokens or not wait > self.max_wait:
            return None
        return QueueFull(f"request {request.request_id!r}: not admitted within --max-wait-time "
                         f"{self.max_wait:g} s (priority {request.priority}, overload); retry later")

    def check(self, request: Request, ahead: int, now: float) -> None:
        if self.bound is None or not ahead:
            return
        wait = self.estimate(ahead, now)
        if wait is not None and wait > self.bound:
            raise QueueFull(
                f"request {request.request_id!r}: expected queue wait {wait:.1f} s for priority {request.priority} "
                f"({ahead} requests ahead) is past --max-expected-wait {self.bound:g} s; retry later")
