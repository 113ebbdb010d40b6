"""What a committed step tells clients: one `RequestEvent` per request that got tokens or
ended, and the step's plain decode tokens in two columns (`PlainTokens`).

At 256 running requests almost every request's step is a *plain* decode: one new token, not
its first, not its last, no logprobs, no prompt logprobs, no speculation. Those travel as
(request id, token) columns from the core to the gateway's wire (`EventBatch`'s packed
columns) without an object per token; everything else is a `RequestEvent`. `StepEvents`
holds both and reads like a list of events (a plain token as a `PlainTokenEvent`), for
code that wants one event per request.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from stepahead.logprobs import Logprobs, PromptLogprobs
from stepahead.plan import FinishReason


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
    """One plain decode token read as an event (the view `StepEvents` and `PlainTokens` give
    of their columns): the other fields are what a plain token implies."""

    request_id: str
    token: int
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


_plain_event = partial(tuple.__new__, PlainTokenEvent)


@dataclass(slots=True)
class PlainTokens:
    """Plain decode tokens of one step (or of one gateway session's share of it): request
    `request_ids[i]` committed the one token `token_ids[i]` and nothing else happened to it.
    A request appears at most once per step, never with a `RequestEvent` of the same step."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def add(self, request_id: str, token: int) -> None:
        self.request_ids.append(request_id)
        self.token_ids.append(token)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self) -> Iterator[PlainTokenEvent]:
        return map(_plain_event, zip(self.request_ids, self.token_ids))


@dataclass(slots=True)
class StepEvents:
    """A committed step's events: `events` (one per request that ended, or got tokens that are
    not plain) and `plain` (the plain decode tokens). Iterating yields both as events, the
    `RequestEvent`s first (no request is in both)."""

    events: list[RequestEvent] = field(default_factory=list)
    plain: PlainTokens = field(default_factory=PlainTokens)

    def __len__(self) -> int:
        return len(self.events) + len(self.plain)

    def __iter__(self) -> Iterator[RequestEvent | PlainTokenEvent]:
        yield from self.events
        yield from self.plain


def split_plain(plain: PlainTokens, sink_of: Callable[[str], Hashable | None]) -> list[tuple[Hashable, PlainTokens]]:
    """Each sink's share of `plain` (`sink_of(request_id)`, None: nobody listens), in order."""
    sinks = list(map(sink_of, plain.request_ids))
    if not sinks:
        return []
    if sinks.count(sinks[0]) == len(sinks):  # one sink (one gateway): the common case, no Python per token
        return [(sinks[0], plain)] if sinks[0] is not None else []
    parts: dict[Hashable, PlainTokens] = {}
    for rid, token, sink in zip(plain.request_ids, plain.token_ids, sinks):
        if sink is not None:
            part = parts.get(sink)
            if part is None:
                part = parts[sink] = PlainTokens()
            part.add(rid, token)
    return list(parts.items())
