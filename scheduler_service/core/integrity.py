"""Invariants of one request, checked by `Scheduler.check_integrity` (tests call it after
every step). Raises AssertionError explicitly so that `python -O` keeps the checks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from scheduler_service.core.kv_manager import cdiv
from scheduler_service.core.request import Request, RequestStatus


def _require(ok: bool, req: Request, what: str) -> None:
    if not ok:
        raise AssertionError(f"{req!r}: {what}")


def check_request(req: Request, block_size: int, max_model_len: int, num_in_flight: int,
                  num_speculative_tokens: int = 0, sliding_window: int = 0) -> None:
    _require(
        req.num_scheduled_tokens >= req.num_computed_tokens >= req.num_committed_tokens,
        req, "scheduled >= computed >= committed violated",
    )
    _require(req.num_scheduled_tokens <= req.num_known_tokens, req, "scheduled past the known tokens")
    _require(
        req.num_output_tokens + req.num_output_placeholders <= req.sampling.max_tokens,
        req, "committed output + placeholders exceed max_tokens",
    )
    _require(req.num_known_tokens <= max_model_len, req, "longer than max_model_len")
    _require(0 <= req.num_output_placeholders <= num_in_flight * (1 + num_speculative_tokens), req,
             "more placeholders than plans in flight can produce")
    owned = req.owned_block_ids
    _require(len(set(owned)) == len(owned), req, "a block appears twice in its table")
    _require(0 <= req.num_slid_blocks <= len(req.block_ids) or req.status is RequestStatus.SWAPPED, req,
             "more holes than blocks")
    _require(req.num_slid_blocks * block_size <= max(req.num_committed_tokens - sliding_window, 0), req,
             "a block freed before every layer's window passed it")
    _require(req.is_running_row == (req.status is RequestStatus.RUNNING), req,
             "holds a running row unless running, and only then")
    match req.status:
        case RequestStatus.RUNNING:
            _require(len(req.block_ids) >= cdiv(req.num_scheduled_tokens, block_size), req, "block table too short")
            _require(not req.host_block_ids, req, "running with host blocks")
        case RequestStatus.SWAPPED:
            _require(not req.block_ids and req.num_output_placeholders == 0, req, "swapped but holds device state")
            _require((req.num_slid_blocks + len(req.host_block_ids)) * block_size >= req.num_computed_tokens, req,
                     "host copy too short")
            _require(req.num_scheduled_tokens == req.num_computed_tokens, req, "swapped with work in flight")
        case RequestStatus.LOADING:
            _require(len(req.block_ids) >= cdiv(req.num_computed_tokens, block_size), req, "block table too short")
            _require(not req.host_block_ids and req.num_output_placeholders == 0, req, "loading with host blocks")
            _require(req.num_scheduled_tokens == req.num_computed_tokens == req.num_prompt_tokens, req,
                     "loading with work beyond its prompt")
        case RequestStatus.WAITING | RequestStatus.PREEMPTED | RequestStatus.PREPARING:
            _require(not req.block_ids and not req.host_block_ids and not req.num_slid_blocks, req,
                     "waiting but holds blocks")
            _require(req.num_scheduled_tokens == req.num_output_placeholders == 0, req, "waiting with work")
        case _:
            raise AssertionError(f"{req!r}: finished but still tracked")


def check_queues(
    requests: Mapping[str, Request], running: Sequence[Request], swapped: Sequence[Request],
    waiting: Sequence[Request], waiting_len: int, loading: Sequence[Request] = (),
    preparing: Sequence[Request] = (),
) -> None:
    """Every tracked request is in exactly the queue its status says; running is sorted."""
    groups = (
        (running, {RequestStatus.RUNNING}),
        (swapped, {RequestStatus.SWAPPED}),
        (waiting, {RequestStatus.WAITING, RequestStatus.PREEMPTED}),
        (loading, {RequestStatus.LOADING}),
        (preparing, {RequestStatus.PREPARING}),
    )
    listed = 0
    for members, statuses in groups:
        for req in members:
            if req.status not in statuses or requests.get(req.request_id) is not req:
                raise AssertionError(f"{req!r} listed among {sorted(s.name for s in statuses)}")
        listed += len(members)
    if listed != len(requests) or waiting_len != len(waiting):
        raise AssertionError(f"{listed} requests in queues, {len(requests)} tracked, waiting {waiting_len}")
    if any(a.run_key > b.run_key for a, b in zip(running, running[1:])):
        raise AssertionError("running requests out of policy order")


def check_core(config, requests: Mapping[str, Request], running, swapped, waiting, kv, in_flight: list[int],
               next_step_id: int, loading: Sequence[Request] = (), held: Sequence[Sequence[int]] = (),
               preparing: Sequence[Request] = ()) -> None:
    """A scheduler core's whole state: requests, pools vs owners, queues, plan order.
    `held`: block lists the core holds for no live request (disaggregation's handed-off KV)."""
    refs, host_refs = Counter(), Counter()
    for blocks in held:
        refs.update(blocks)
    for req in requests.values():
        check_request(req, config.block_size, config.max_model_len, len(in_flight), config.num_speculative_tokens,
                      config.sliding_window)
        refs.update(req.owned_block_ids)
        host_refs.update(req.host_block_ids)
    kv.device.check_integrity(refs)
    kv.host.check_integrity(host_refs)
    check_queues(requests, running, swapped, waiting.requests(), len(waiting), loading, preparing)
    running.check()
    if in_flight != list(range(next_step_id - len(in_flight), next_step_id)):
        raise AssertionError(f"in-flight plans out of order: {in_flight}")
