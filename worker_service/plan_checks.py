"""Validation of a StepPlan against the worker's state, before anything is mutated."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from stepahead import limits
from stepahead.logprobs import MAX_LOGPROBS
from stepahead.plan import StepPlan

if TYPE_CHECKING:  # torch-free at run time: the sim worker checks plans with these rules too
    from worker_service.input_batch import CachedRequest


class PlanError(ValueError):
    """A plan the worker cannot execute; the message names the request and the problem."""


def kv_loader_for(plan: StepPlan, loader, num_blocks: int):
    """The runner's loader (`kv_loads.KVLoader`) for a plan with `kv_loads`, their destination
    blocks checked against the pool; PlanError before anything changed otherwise."""
    if loader is None:
        raise PlanError("kv_loads: this worker has no KV loader (it loads only inside an attach session)")
    for load in plan.kv_loads:
        try:
            limits.check_kv_blocks("kv_loads.dst_block_ids", load.dst_block_ids, num_blocks)
        except limits.LimitError as exc:
            raise PlanError(f"transfer {load.transfer_id}: {exc}") from None
    return loader


def check_plan(plan: StepPlan, requests: dict[str, CachedRequest], prev_rows: dict[str, int], *,
               num_blocks: int, block_size: int, max_model_len: int, vocab_size: int | None = None) -> None:
    """Raises PlanError for anything that would index out of range on the device (a sticky
    device-side assert on CUDA) or read a token id the host does not have yet.

    `vocab_size=None` skips the token-id range check (for callers without an embedding).
    Running requests take a fast path (one expression per request, on the host's critical
    path every step); only a request that fails it, or brings new blocks, is checked in
    detail, which names the problem.
    """
    for r in plan.new_requests:
        if r.request_id in requests:
            raise PlanError(f"new request {r.request_id!r} is already known to the worker")
        _check_blocks(r.request_id, r.block_ids, num_blocks)
        if vocab_size is not None and r.token_ids and not (0 <= min(r.token_ids) and max(r.token_ids) < vocab_size):
            raise PlanError(f"new request {r.request_id!r}: token ids outside the vocabulary [0, {vocab_size})")
        _check_span(r.request_id, len(r.token_ids), r.num_computed_tokens, r.num_scheduled_tokens,
                    len(r.block_ids), block_size, max_model_len)
    for r in plan.running:
        state = requests.get(r.request_id)
        if state is None:
            raise PlanError(f"running request {r.request_id!r} is unknown to the worker")
        n = r.num_scheduled_tokens
        end = state.num_computed + n
        tokens = state.token_ids
        if r.new_block_ids or r.num_draft_tokens or not (
            0 < n and end <= max_model_len and len(state.block_ids) * block_size >= end
            and ((n == 1 and end == len(tokens) and r.request_id in prev_rows) if r.input_is_placeholder
                 else (end <= len(tokens) and tokens[end - 1] >= 0))
        ):
            _check_running(r, state, prev_rows, num_blocks, block_size, max_model_len)
    _check_unique(plan)


def _check_running(r, state: CachedRequest, prev_rows: dict[str, int], num_blocks: int, block_size: int,
                   max_model_len: int) -> None:
    _check_blocks(r.request_id, r.new_block_ids, num_blocks)
    # drafts (speculative decoding) are proposed here: only the input must be known, but the
    # blocks and the length limit must hold all 1 + num_draft_tokens positions
    n_in = r.num_scheduled_tokens - r.num_draft_tokens
    if r.num_draft_tokens and n_in != 1:
        raise PlanError(f"request {r.request_id!r}: {r.num_draft_tokens} drafts allowed on a step of "
                        f"{r.num_scheduled_tokens} tokens; drafts need a one-token decode")
    if r.input_is_placeholder:
        if n_in != 1 or r.request_id not in prev_rows or state.num_computed + 1 != len(state.token_ids):
            raise PlanError(f"request {r.request_id!r}: placeholder input needs a one-token decode "
                            "of the token its request sampled in the previous step")
    _check_span(r.request_id, len(state.token_ids) + r.num_draft_tokens, state.num_computed, r.num_scheduled_tokens,
                len(state.block_ids) + len(r.new_block_ids), block_size, max_model_len)
    end = state.num_computed + n_in
    # a reserved slot (-1) is filled only when its step's ids reach the host
    if not r.input_is_placeholder and state.token_ids[end - 1] < 0:
        raise PlanError(f"request {r.request_id!r}: input token {end - 1} was sampled by a step still "
                        "in flight; only a placeholder decode may read it")


def _check_unique(plan: StepPlan) -> None:
    ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.running]
    if len(set(ids)) == len(ids):
        return
    seen: set[str] = set()
    for i, rid in enumerate(ids):
        if rid in seen:
            if i < len(plan.new_requests):
                raise PlanError(f"new request {rid!r} is already known to the worker")
            raise PlanError(f"request {rid!r} appears twice in the plan")
        seen.add(rid)


def _check_blocks(rid: str, block_ids, num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise PlanError(f"request {rid!r}: block ids {bad} outside the device pool [0, {num_blocks})")


def _check_span(rid: str, known: int, computed: int, scheduled: int, blocks: int, block_size: int,
                max_model_len: int) -> None:
    if scheduled < 1:
        raise PlanError(f"request {rid!r}: num_scheduled_tokens must be >= 1, got {scheduled}")
    end = computed + scheduled
    if end > known:
        raise PlanError(f"request {rid!r}: step computes tokens up to {end} but the worker knows only {known}")
    if end > max_model_len:
        raise PlanError(f"request {rid!r}: position {end - 1} >= max model length {max_model_len}")
    if blocks * block_size < end:
        raise PlanError(f"request {rid!r}: block table of {blocks} blocks (block size {block_size}) is too "
                        f"short for {end} tokens")


def split_bad_sampling_rows(plan: StepPlan, vocab_size: int, failed_ids: set[str],
                            max_logprobs: int | None = MAX_LOGPROBS) -> tuple[StepPlan, dict[str, str]]:
    """Take out of `plan` the new requests whose sampling rows break the shared limits
    (`stepahead.limits`), and deltas of requests that already failed here; returns the plan
    that runs and {request id: reason} for the newly failed ones (added to `failed_ids`).
    `max_logprobs=None`: this worker computes no logprobs (`--device sim`); rows asking fail.

    Rows that pass are normalised by the same rules, so the sampler sees exactly what the
    gateway and the scheduler accepted. One bad row never fails its step.
    """
    new, failed = [], {}
    for r in plan.new_requests:
        try:
            if max_logprobs is None and (r.sampling.logprobs, r.sampling.prompt_logprobs) != (None, None):
                raise limits.LimitError("sampling.logprobs", "this worker does not compute logprobs (--device sim)")
            sampling = limits.check_sampling(r.sampling, vocab_size, max_logprobs or 0, meta_schema=False)
        except limits.LimitError as exc:
            failed[r.request_id] = f"invalid sampling row: {exc}"
            continue
        new.append(r if sampling == r.sampling else dataclasses.replace(r, sampling=sampling))
    failed_ids.update(failed)
    # the usual step fails nothing: no pass over the running deltas, no new plan
    running = [r for r in plan.running if r.request_id not in failed_ids] if failed_ids else plan.running
    if not failed and len(running) == len(plan.running) and all(a is b for a, b in zip(new, plan.new_requests)):
        return plan, failed
    return dataclasses.replace(plan, new_requests=tuple(new), running=tuple(running)), failed
