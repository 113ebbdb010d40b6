"""What a submission must satisfy before the scheduler core takes it (pure Python).

A gateway is a network peer like any other: every submission is checked against the
shared limits (`stepahead.limits`) again, against the KV pool, and against the waiting
queue's bound. The checked request's sampling params are the normalised ones.
"""

from __future__ import annotations

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
        request.sampling = limits.check_sampling(request.sampling, vocab, config.max_logprobs)
    except limits.LimitError as exc:
        raise RequestRejected(f"request {request.request_id!r}: {exc}") from None


def check_fits(config: SchedulerConfig, request: Request) -> None:
    """The request at its longest must fit the device pool alone."""
    n = request.num_prompt_tokens
    final_len = min(n + request.sampling.max_tokens, config.max_model_len)
    blocks = cdiv(final_len - 1, config.block_size)  # the last sampled token is never computed
    if blocks > config.num_gpu_blocks:
        raise RequestRejected(
            f"request {request.request_id!r}: needs up to {blocks} KV blocks ({final_len} tokens) but the device "
            f"pool has only {config.num_gpu_blocks}"
        )
