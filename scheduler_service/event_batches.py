"""A gateway session's events as the `EventBatch` messages its Connect stream sends (the
servicer's proto conversion of events; see `EventBatch` in protos/stepahead/v1/scheduler.proto).

At 256 streams almost every event of a step is a *plain* decode token (one request, one new
token, nothing else), and the core hands them over as columns (`events.PlainTokens`). Those
go in the batch's two packed columns instead of one `TokenEvent` each: no submessage to
build here, none to parse and walk at the gateway. Everything else is a full `TokenEvent`.
The receiver applies a batch's `events` before its plain tokens, so a request's plain token
followed (in the session's merged lists) by another event of the same request closes the
batch and the event starts the next one.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_service.core.events import PlainTokens, RequestEvent
from scheduler_service.links import RejectCode, Rejected
from stepahead import codec
from stepahead.columns import pack_ids, pack_u32
from stepahead.v1 import common_pb2, scheduler_pb2

REJECT_CODES = {
    RejectCode.INVALID: scheduler_pb2.REJECT_CODE_INVALID,
    RejectCode.UNAVAILABLE: scheduler_pb2.REJECT_CODE_UNAVAILABLE,
    RejectCode.QUEUE_FULL: scheduler_pb2.REJECT_CODE_QUEUE_FULL,
}


def event_batches(events: Iterable[PlainTokens | RequestEvent | Rejected],
                  scope_len: int = 0) -> list[scheduler_pb2.EventBatch]:
    """`events` in order as EventBatch messages (one unless the order rule splits them).
    Events carry the scoped id; the scope (`scope_len` chars) is cut off: the gateway's own id."""
    out = [scheduler_pb2.EventBatch()]
    rids: list[str] = []  # the plain columns of out[-1], still to be written (scoped ids)
    tokens: list[int] = []
    pending: set[str] | None = None  # the set of `rids`, built once an event follows them
    for e in events:
        if type(e) is PlainTokens:  # the hot path: a step's plain tokens, no Python per token
            rids += e.request_ids
            tokens += e.token_ids
            if pending is not None:
                pending.update(e.request_ids)
            continue
        if rids and pending is None:
            pending = set(rids)
        if rids and e.request_id in pending:  # it must apply after that plain token: next batch
            _fill_columns(out[-1], rids, tokens, scope_len)
            out.append(scheduler_pb2.EventBatch())
            rids, tokens, pending = [], [], None
        if type(e) is Rejected:
            out[-1].events.append(rejection_to_proto(e, scope_len))
        else:
            add_event(out[-1], e, scope_len)
    _fill_columns(out[-1], rids, tokens, scope_len)
    return out


def _fill_columns(batch: scheduler_pb2.EventBatch, rids: list[str], tokens: list[int], scope_len: int) -> None:
    if rids:
        batch.token_request_ids = _unscoped_ids(rids, scope_len)
        batch.token_ids = pack_u32(tokens)


def _unscoped_ids(rids: list[str], scope_len: int) -> bytes:
    """The packed ids (`stepahead.columns`) without their session's scope, cut off all at once."""
    if not scope_len:
        return pack_ids(rids)
    scope = "\0" + rids[0][:scope_len]
    joined = "\0" + "\0".join(rids) + "\0"
    if joined.count(scope) != len(rids):  # never from the engine: one session, one scope
        return pack_ids([rid[scope_len:] for rid in rids])
    return joined.replace(scope, "\0")[1:].encode()


def add_event(batch: scheduler_pb2.EventBatch, event: RequestEvent, scope_len: int = 0) -> None:
    """Append `event` to `batch` as a full TokenEvent, setting only the fields that differ
    from their defaults."""
    msg = batch.events.add()  # then fields one by one: faster than add(**fields) on upb
    msg.request_id = event.request_id[scope_len:]
    msg.token_ids.extend(event.new_token_ids)
    msg.num_prompt_tokens = event.num_prompt_tokens
    if event.finish_reason is not None:
        msg.finish_reason = codec.finish_reason_to_proto(event.finish_reason)
    if event.num_cached_tokens:
        msg.num_cached_tokens = event.num_cached_tokens
    if event.message:
        msg.message = event.message
    if event.rejected:  # its reject_code is the default, REJECT_CODE_INVALID
        msg.rejected = True
    if event.logprobs:
        msg.logprobs.extend(codec.logprobs_to_proto(lp) for lp in event.logprobs)
    if event.num_draft_tokens:
        msg.num_draft_tokens = event.num_draft_tokens
        msg.num_accepted_tokens = event.num_accepted_tokens
        msg.num_spec_steps = event.num_spec_steps
    if event.prompt_logprobs is not None:
        msg.prompt_logprobs_start = event.prompt_logprobs.start
        msg.prompt_logprobs.extend(codec.logprobs_to_proto(lp) for lp in event.prompt_logprobs.entries)


def rejection_to_proto(r: Rejected, scope_len: int = 0) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(
        request_id=r.request_id[scope_len:], finish_reason=common_pb2.FINISH_REASON_ERROR, rejected=True,
        message=r.message, reject_code=REJECT_CODES[r.code],
    )
