"""Plain decode tokens as the gateway's event consumers read them.

An `EventBatch` carries most decode tokens in two packed columns (request id, token) instead
of one `TokenEvent` each (see `EventBatch` in protos/stepahead/v1/scheduler.proto). The link's
reader hands each of them to its request's sink as a `PlainToken`: an object with every
attribute downstream code reads of a `TokenEvent` (`request_id`, `token_ids`,
`finish_reason`, `rejected`, `message`, `logprobs`, `prompt_logprobs`, the counts), the
defaults of a plain token fixed on the class, so building one is four slot writes. Its
`num_prompt_tokens` / `num_cached_tokens` are the request's, from its last event that
carried tokens (a request's first event always does), so usage is exact when a plain token
ends the request at the gateway (a stop string, an abort).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from stepahead.columns import unpack_ids, unpack_u32
from stepahead.v1 import common_pb2, scheduler_pb2


class MalformedBatch(ValueError):
    """An EventBatch that breaks the protocol (the gateway drops the stream, as for a message
    that does not parse)."""


class OpenRequest:
    """One request open on a scheduler link: its event sink, its prompt / cached counts (from
    its latest event with tokens; 0 until one arrived) and the link's stream it went out on
    (None until it did)."""

    __slots__ = ("sink", "num_prompt_tokens", "num_cached_tokens", "stream")

    def __init__(self, sink: Callable[[object], None]) -> None:
        self.sink = sink
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.stream = None


class PlainToken:
    """A request's committed tokens of one or more plain steps (one token each) and nothing
    else, read like a `TokenEvent`."""

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "num_cached_tokens")
    finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
    rejected = False
    reject_code = scheduler_pb2.REJECT_CODE_INVALID
    message = ""
    logprobs = ()
    prompt_logprobs = ()
    prompt_logprobs_start = 0
    num_draft_tokens = 0
    num_accepted_tokens = 0
    num_spec_steps = 0

    def __init__(self, request_id: str, token_ids: tuple[int], num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens  # the scheduler pool may subtract its failover offset
        self.num_cached_tokens = num_cached_tokens

    def to_proto(self) -> scheduler_pb2.TokenEvent:
        return scheduler_pb2.TokenEvent(request_id=self.request_id, token_ids=self.token_ids,
                                        num_prompt_tokens=self.num_prompt_tokens,
                                        num_cached_tokens=self.num_cached_tokens)

    def __repr__(self) -> str:
        return (f"PlainToken({self.request_id!r}, {self.token_ids!r}, {self.num_prompt_tokens}, "
                f"{self.num_cached_tokens})")


TOKEN_EVENTS = (scheduler_pb2.TokenEvent, PlainToken)  # what carries a request's tokens to its consumer


def deliver(batch: scheduler_pb2.EventBatch, routes: Mapping[str, OpenRequest]) -> None:
    """Hand the batch's events, then its plain tokens, to their open requests' sinks (a
    request that is not open is skipped: it ended here, e.g. on a stop string).

    Raises `MalformedBatch` before delivering anything when the plain columns differ in length.
    """
    try:
        rids = unpack_ids(batch.token_request_ids, "token_request_ids")
        tokens = unpack_u32(batch.token_ids, "token_ids")
    except ValueError as exc:
        raise MalformedBatch(str(exc)) from None
    if len(rids) != len(tokens):
        raise MalformedBatch(f"token_request_ids has {len(rids)} entries but token_ids has {len(tokens)}")
    get = routes.get
    for event in batch.events:
        route = get(event.request_id)
        if route is not None:
            if event.token_ids:
                route.num_prompt_tokens, route.num_cached_tokens = event.num_prompt_tokens, event.num_cached_tokens
            route.sink(event)
    if len(set(rids)) < len(rids):  # several steps' tokens (held by the scheduler, or merged behind)
        for rid, run in _runs(rids, tokens).items():
            route = get(rid)
            if route is not None:  # one event per request and batch, its tokens in order
                route.sink(PlainToken(rid, tuple(run), route.num_prompt_tokens, route.num_cached_tokens))
        return
    for rid, token in zip(rids, tokens):
        route = get(rid)
        if route is not None:
            route.sink(PlainToken(rid, (token,), route.num_prompt_tokens, route.num_cached_tokens))


def _runs(rids: list[str], tokens: list[int]) -> dict[str, list[int]]:
    """Each request's tokens of the columns, in order (requests in order of first appearance)."""
    runs: dict[str, list[int]] = {}
    for rid, token in zip(rids, tokens):
        run = runs.get(rid)
        if run is None:
            runs[rid] = [token]
        else:
            run.append(token)
    return runs
