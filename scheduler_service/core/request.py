"""A request as the scheduler sees it (nano-vllm `Sequence`-like).

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

While a request runs, its per-step counters (`COLUMN_COUNTERS`) live in a row of its core's
running set (`running_set.RunningColumns`), where the bulk decode path advances every
running request at once; the attributes read and write that row, so every reader sees the
same values whether the request runs or not.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from operator import attrgetter

from stepahead import limits
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
    LOADING = "loading"  # moved here from a prefill replica: holds blocks its KV is being loaded into
    PREPARING = "preparing"  # its grammar compiles on the worker; queued once the worker reports it
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


NEVER = sys.maxsize  # `Request.handoff_at` of a request that never leaves its core


@dataclass(frozen=True)
class KVSource:
    """Where a request moved from a prefill replica has its prompt's KV (disaggregation)."""

    address: str  # the source worker's KV transfer service (host:port)
    block_ids: tuple[int, ...]  # its device blocks there, in sequence order (held until released)
    transfer_id: int  # the engine's id of the move
    instance: str = ""  # the source's KV transfer instance (no restarted worker serves it)


# Counters kept in the running set's columns while the request runs (same names there).
COLUMN_COUNTERS = ("num_tokens", "num_scheduled_tokens", "num_computed_tokens", "num_output_placeholders",
                   "last_step_id")


def _column_counter(name: str) -> property:
    """An int attribute kept on the request (`_<name>`) until it runs, then in its running
    set's column `name` (row `_row`); the request's values move with it (`running_set`)."""
    local = "_" + name
    get_local, get_column = attrgetter(local), attrgetter(name)

    def fget(self) -> int:
        columns = self._columns
        return get_local(self) if columns is None else get_column(columns)[self._row]

    def fset(self, value: int) -> None:
        columns = self._columns
        if columns is None:
            setattr(self, local, value)
        else:
            get_column(columns)[self._row] = value

    return property(fget, fset, doc=f"{name} (in the running set's columns while running)")


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling",
        "priority",
        "arrival_time",
        "cache_salt",
        "output_token_ids",
        "status",
        "_block_ids",
        "host_block_ids",
        "num_slid_blocks",
        "num_cached_tokens",
        "num_preemptions",
        "output_at_preemption",
        "first_scheduled_time",
        "queued_time",
        "epoch",
        "in_worker",
        "block_hashes",
        "prefix_ids",
        "queue_token",
        "run_key",
        "prompt_logprobs_end",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_spec_steps",
        "handoff_at",
        "kv_source",
        "_columns",  # the running set's columns while running, else None
        "_row",  # ... and the row there
        *("_" + name for name in COLUMN_COUNTERS),
    )

    num_tokens = _column_counter("num_tokens")  # committed tokens: prompt + committed output
    num_scheduled_tokens = _column_counter("num_scheduled_tokens")
    num_computed_tokens = _column_counter("num_computed_tokens")
    num_output_placeholders = _column_counter("num_output_placeholders")
    last_step_id = _column_counter("last_step_id")  # newest plan that touched this request's blocks

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
        self._columns = None
        self._row = -1
        self.num_tokens = len(prompt)
        self.status = RequestStatus.WAITING
        self._block_ids: list[int] = []  # device KV blocks, in sequence order (`block_ids`)
        self.host_block_ids: list[int] = []  # host copies while SWAPPED
        # leading blocks every layer's sliding window has passed, given back to the pool: their
        # entries in `block_ids` are holes (ids the worker's masks never read), not owned blocks
        self.num_slid_blocks = 0
        self.num_scheduled_tokens = 0
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission (reported to clients)
        self.num_preemptions = 0
        self.output_at_preemption = 0  # output tokens committed when it was last preempted (`preemption.py`)
        self.first_scheduled_time: float | None = None
        self.queued_time: float | None = None  # when it last entered the waiting queue
        # Scheduler bookkeeping.
        self.epoch = 0  # bumped on preempt / finish: older in-flight results become stale
        self.last_step_id = -1
        self.in_worker = False  # the worker holds this request (sent as NewRequest, not forgotten)
        self.block_hashes: list[int] = []  # chained hashes of full committed blocks
        self.prefix_ids: list[int] = []  # content identities of this request's cached blocks
        self.queue_token: int | None = None  # live entry in the waiting queue
        self.run_key: tuple = ()  # policy order while running (fixed when it starts running)
        self.prompt_logprobs_end = 1  # prompt logprobs delivered for positions [1, end)
        self.num_draft_tokens = 0  # speculative decoding: drafts the worker proposed and verified
        self.num_accepted_tokens = 0  # ... and accepted (committed or not)
        self.num_spec_steps = 0  # steps that verified at least one of its drafts
        # Disaggregation. On a prefill replica's core: the known tokens at which the request
        # leaves it (one sampled token after it came), never scheduled past them; NEVER elsewhere.
        self.handoff_at = NEVER
        # On a decode replica's core, until its KV is loaded (or given up): where that KV is.
        self.kv_source: KVSource | None = None

    @property
    def block_ids(self) -> list[int]:
        """Device KV blocks, in sequence order. Change them only by assigning a new list or with
        `extend_blocks` (never otherwise in place): while running, the running set keeps the
        table's length in a column."""
        return self._block_ids

    @block_ids.setter
    def block_ids(self, blocks: list[int]) -> None:
        self._block_ids = blocks
        if self._columns is not None:
            self._columns.blocks_changed(self._row, len(blocks))

    def extend_blocks(self, blocks: Iterable[int]) -> None:
        """Append to the block table in place. A decode gets a block every `block_size` steps:
        a copy of its table each time would also hand the garbage collector a new list to walk
        at its next young collection, for every running request."""
        table = self._block_ids
        table.extend(blocks)
        if self._columns is not None:
            self._columns.blocks_changed(self._row, len(table))

    @property
    def owned_block_ids(self) -> list[int]:
        """The blocks of `block_ids` it holds: those after the sliding window's holes."""
        return self._block_ids[self.num_slid_blocks:] if self.num_slid_blocks else self._block_ids

    @property
    def is_running_row(self) -> bool:
        """Its counters are in a running set's columns (it runs on a core)."""
        return self._columns is not None

    @property
    def running_row(self) -> int:
        """Its row in the running set's columns (-1: not running)."""
        return self._row

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
