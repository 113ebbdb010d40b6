"""A request as the scheduler sees it (nano-vllm `Sequence`-like), plus its events.

Status changes happen only in named `Scheduler` methods (`_admit`, `_preempt`,
`_swap_in`, `_finish`); nothing else assigns `status`.

Counters (positions in the sequence prompt + output):
- `num_scheduled_tokens`: tokens whose KV computation has been sent to the worker,
  including steps still in flight.
- `num_computed_tokens`: tokens whose computation a processed result confirmed.
- `num_committed_tokens`: leading tokens that are both computed and committed (the part
  that may enter the prefix cache).
- `num_output_placeholders`: sampled tokens of in-flight steps, not yet committed.
Always `num_scheduled >= num_computed >= num_committed` and
`num_output_tokens + num_output_placeholders <= max_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import NamedTuple

from stepahead import limits
from stepahead.logprobs import Logprobs, PromptLogprobs
from stepahead.plan import FinishReason, SamplingParams


class RequestRejected(ValueError):
    """A request that can never be served (bad input): raised by `Scheduler.add_request`."""


class QueueFull(RequestRejected):
    """The waiting queue is at `max_queued_requests`: the request may be retried later."""


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: back in the waiting queue without KV
    SWAPPED = "swapped"  # KV in the host pool
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED



_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}

FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True)
class RequestEvent:
    """What a client sees after a step: newly committed tokens and, at the end, why.

    Never changed once built (treat as immutable). Not `frozen`: one is built per running
    request per step, and a frozen dataclass's __init__ costs ~4x a slotted one's."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    message: str = ""  # with FinishReason.ERROR: what failed
    queue_time: float | None = None  # on the first token's event: arrival to first scheduled
    rejected: bool = False  # with ERROR: the request itself was invalid (the client gets INVALID_ARGUMENT)
    logprobs: tuple[Logprobs, ...] = ()  # with sampling.logprobs: one per new token
    prompt_logprobs: PromptLogprobs | None = None  # newly computed prompt positions (never twice)
    # speculative decoding, on the final event: drafts verified and accepted over the request
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0


class PlainTokenEvent(NamedTuple):
    """A `RequestEvent` with one new token and nothing else: a running request's plain decode,
    not its first token, not its last, no logprobs, no speculation. Almost every event of a
    step at high concurrency is one. It reads like a `RequestEvent` (the other fields are the
    class constants below), but is a 4-tuple built at C speed (`plain_token_event`), and the
    gateway writer packs it into `EventBatch`'s token columns by its type alone."""

    request_id: str
    token: int
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason = None
    message = ""
    queue_time = None
    rejected = False
    logprobs = ()
    prompt_logprobs = None
    num_draft_tokens = 0
    num_accepted_tokens = 0
    num_spec_steps = 0

    @property
    def new_token_ids(self) -> tuple[int, ...]:
        return (self.token,)


# A PlainTokenEvent from one (request_id, token, num_prompt_tokens, num_cached_tokens) tuple.
plain_token_event = partial(tuple.__new__, PlainTokenEvent)


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling",
        "priority",
        "arrival_time",
        "cache_salt",
        "output_token_ids",
        "num_tokens",
        "status",
        "block_ids",
        "host_block_ids",
        "num_scheduled_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_cached_tokens",
        "num_preemptions",
        "first_scheduled_time",
        "queued_time",
        "epoch",
        "last_step_id",
        "in_worker",
        "block_hashes",
        "prefix_ids",
        "queue_token",
        "run_key",
        "prompt_logprobs_end",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_spec_steps",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestRejected(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = tuple(prompt_token_ids)
        try:  # the shape of a request; the full limits are checked when it is submitted
            if not prompt:
                raise limits.LimitError("prompt.token_ids", "the prompt is empty")
            if any(not isinstance(t, int) or t < 0 for t in prompt):
                raise limits.LimitError("prompt.token_ids", "token ids must be non-negative ints")
            limits.check_output_budget(sampling.max_tokens, sampling.min_tokens)
        except limits.LimitError as exc:
            raise RequestRejected(f"request {request_id!r}: {exc}") from None
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.sampling = sampling
        self.priority = priority
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        self.num_tokens = len(prompt)  # committed tokens: prompt + committed output
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []  # device KV blocks, in sequence order
        self.host_block_ids: list[int] = []  # host copies while SWAPPED
        self.num_scheduled_tokens = 0
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (reported to clients)
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.queued_time: float | None = None  # when it last entered the waiting queue
        # Scheduler bookkeeping.
        self.epoch = 0  # bumped on preempt / finish: older in-flight results become stale
        self.last_step_id = -1  # newest plan that touched this request's blocks
        self.in_worker = False  # the worker holds this request (sent as NewRequest, not forgotten)
        self.block_hashes: list[int] = []  # chained hashes of full committed blocks
        self.prefix_ids: list[int] = []  # content identities of this request's cached blocks
        self.queue_token: int | None = None  # live entry in the waiting queue
        self.run_key: tuple = ()  # policy order while running (fixed when it starts running)
        self.prompt_logprobs_end = 1  # prompt logprobs delivered for positions [1, end)
        self.num_draft_tokens = 0  # speculative decoding: drafts the worker proposed and verified
        self.num_accepted_tokens = 0  # ... and accepted (committed or not)
        self.num_spec_steps = 0  # steps that verified at least one of its drafts

    def commit_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1

    # ---- lengths -------------------------------------------------------------------
    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None or self.arrival_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens the worker will know once in-flight steps ran: committed + placeholders."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_committed_tokens(self) -> int:
        return min(self.num_computed_tokens, self.num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: the prompt may not come from the prefix cache."""
        return self.sampling.prompt_logprobs is not None and self.prompt_logprobs_end < self.num_prompt_tokens

    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def token_ids_range(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens [start, end) of prompt + output, without building the whole sequence."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return tuple(self.output_token_ids[start - n : end - n])
        return prompt[start:] + tuple(self.output_token_ids[: end - n])

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"sched={self.num_scheduled_tokens}, comp={self.num_computed_tokens}, "
            f"ph={self.num_output_placeholders}, blocks={len(self.block_ids)})"
        )
