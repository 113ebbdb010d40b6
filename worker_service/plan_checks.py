"""Validation of a StepPlan against the worker's state, before anything is mutated."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from stepahead import limits
from stepahead.plan import StepPlan

if TYPE_CHECKING:  # torch-free at run time: the sim worker checks plans with these rules too
    from worker_service.input_batch import CachedRequest


class PlanError(ValueError):
    """A plan the worker cannot execute; the message names the request and the problem."""


def check_plan(plan: StepPlan, requests: dict[str, CachedRequest], prev_rows: dict[str, int], *,
               num_blocks: int, block_size: int, max_model_len: int) -> None:
    seen: set[str] = set()
    for r in plan.new_requests:
        if r.request_id in requests or r.request_id in seen:
            raise PlanError(f"new request {r.request_id!r} is already known to the worker")
        seen.add(r.request_id)
        _check_blocks(r.request_id, r.block_ids, num_blocks)
        _check_span(r.request_id, len(r.token_ids), r.num_computed_tokens, r.num_scheduled_tokens,
                    len(r.block_ids), block_size, max_model_len)
    for r in plan.running:
        state = requests.get(r.request_id)
        if state is None:
            raise PlanError(f"running request {r.request_id!r} is unknown to the worker")
        if r.request_id in seen:
            raise PlanError(f"request {r.request_id!r} appears twice in the plan")
        seen.add(r.request_id)
        _check_blocks(r.request_id, r.new_block_ids, num_blocks)
        if r.input_is_placeholder and (r.num_scheduled_tokens != 1 or r.request_id not in prev_rows):
            raise PlanError(f"request {r.request_id!r}: placeholder input needs a one-token decode "
                            "of a request that sampled in the previous step")
        _check_span(r.request_id, len(state.token_ids), state.num_computed, r.num_scheduled_tokens,
                    len(state.block_ids) + len(r.new_block_ids), block_size, max_model_len)


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


def split_bad_sampling_rows(plan: StepPlan, vocab_size: int, failed_ids: set[str]) -> tuple[StepPlan, dict[str, str]]:
    """Take out of `plan` the new requests whose sampling rows break the shared limits
    (`stepahead.limits`), and deltas of requests that already failed here; returns the plan
    that runs and {request id: reason} for the newly failed ones (added to `failed_ids`).

    Rows that pass are normalised by the same rules, so the sampler sees exactly what the
    gateway and the scheduler accepted. One bad row never fails its step.
    """
    new, failed = [], {}
    for r in plan.new_requests:
        try:
            sampling = limits.check_sampling(r.sampling, vocab_size)
        except limits.LimitError as exc:
            failed[r.request_id] = f"invalid sampling row: {exc}"
            continue
        new.append(r if sampling == r.sampling else dataclasses.replace(r, sampling=sampling))
    failed_ids.update(failed)
    running = [r for r in plan.running if r.request_id not in failed_ids]
    if not failed and len(running) == len(plan.running) and all(a is b for a, b in zip(new, plan.new_requests)):
        return plan, failed
    return dataclasses.replace(plan, new_requests=tuple(new), running=tuple(running)), failed
