"""Validation of a worker's StepResult against the plan it answers, before anything is
committed: the scheduler's mirror of the worker's `plan_checks.py`.

A result is a network message: tokens exactly for the requests that sample (stale or failed
ones may be missing), each inside the vocabulary; failures only for requests of the plan;
speculation outcomes only for requests allowed drafts, within their allowance; logprobs
only of sampled tokens (and accepted drafts), well formed; timings finite and non-negative.
Every check raises ValueError naming the step and what is wrong.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from stepahead.columns import SampledTokens, pack_ids
from stepahead.logprobs import MAX_LOGPROBS, Logprobs
from stepahead.plan import StepResult, WorkerTiming

if TYPE_CHECKING:
    from scheduler_service.core.step_builder import InFlightPlan


def check_result(plan: InFlightPlan, result: StepResult, vocab_size: int | None = None,
                 max_logprobs: int = MAX_LOGPROBS) -> list[int] | None:
    """Tokens exactly for the requests that sample (stale or failed ones may be missing),
    each inside the vocabulary; failures only for requests of this plan. A result is a
    network message: raises ValueError naming what is wrong, before anything changes.
    Returns the tokens in the plan's sampling order when the result lists exactly the
    requests of `sampling`, in that order (the common case: nothing to look up by id);
    else None."""
    tokens, failed = result.sampled_token_ids, result.failed
    ordered = None if failed else _in_order(tokens, plan.sampling)
    if ordered is None:
        _check_sampled_ids(plan, result)
    values = ordered if ordered is not None else list(tokens.values())
    if vocab_size is not None and values and not (0 <= min(values) and max(values) < vocab_size):
        bad = [t for t in values if not 0 <= t < vocab_size]
        raise ValueError(f"result {result.step_id} has token ids outside the vocabulary: {bad[:8]}")
    check_speculation(result, plan.draft_allowance, vocab_size)
    if result.logprobs or result.prompt_logprobs:
        check_logprobs(result, tokens, plan.plan_ids(), vocab_size, max_logprobs)
    return ordered

def _check_sampled_ids(plan: InFlightPlan, result: StepResult) -> None:
    tokens, failed, sampling = result.sampled_token_ids, result.failed, frozenset(plan.sampling)
    extra = tokens.keys() - sampling
    if extra:
        raise ValueError(f"result {result.step_id} has tokens for requests it did not sample: {sorted(extra)[:8]}")
    if failed or result.invalid_ids:
        _check_failed(plan, result)
    missing = sampling - tokens.keys() - failed.keys()
    if missing:  # only fresh entries must have a token
        missing &= plan.fresh_ids()
    if missing:
        raise ValueError(f"result {result.step_id} lacks sampled tokens for {sorted(missing)[:8]}")

def _check_failed(plan: InFlightPlan, result: StepResult) -> None:
    failed = result.failed
    both = failed.keys() & result.sampled_token_ids.keys()
    if both:
        raise ValueError(f"result {result.step_id} has both a token and a failure for {sorted(both)[:8]}")
    if not failed.keys() >= set(result.invalid_ids):
        raise ValueError(f"result {result.step_id} lists invalid requests that did not fail")
    unknown = failed.keys() - plan.plan_ids()
    if unknown:
        raise ValueError(f"result {result.step_id} reports failures of requests it did not run: {sorted(unknown)[:8]}")


def _in_order(tokens: Mapping[str, int], sampling: list[str]) -> list[int] | None:
    """`tokens`' values if its ids are exactly `sampling`, in order; else None. Off the wire
    the packed ids are compared as bytes (no id parsed)."""
    if len(tokens) != len(sampling):
        return None
    if isinstance(tokens, SampledTokens):
        return tokens.tokens if tokens.packed_ids == pack_ids(sampling) else None
    return list(tokens.values()) if list(tokens) == sampling else None


def check_speculation(result: StepResult, allowance: dict[str, int], vocab_size: int | None) -> None:
    """A worker's speculation report is a network message: raises ValueError naming what is wrong."""
    spec = result.speculation
    if not spec:
        return
    extra = spec.keys() - allowance.keys()
    if extra:
        raise ValueError(f"result {result.step_id} has speculation outcomes for requests allowed no drafts: "
                         f"{sorted(extra)[:8]}")
    for rid, outcome in spec.items():
        if rid not in result.sampled_token_ids:
            raise ValueError(f"result {result.step_id}: speculation outcome for {rid!r} without a sampled token")
        if not len(outcome.accepted_token_ids) <= outcome.num_draft_tokens <= allowance[rid]:
            raise ValueError(
                f"result {result.step_id}: request {rid!r} reports {outcome.num_draft_tokens} drafts "
                f"({len(outcome.accepted_token_ids)} accepted) but was allowed {allowance[rid]}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in outcome.accepted_token_ids):
            raise ValueError(f"result {result.step_id}: request {rid!r} has accepted token ids outside the vocabulary")


def check_logprobs(result: StepResult, sampled_ids: dict[str, int], plan_ids: set[str],
                          vocab_size: int | None, max_logprobs: int) -> None:
    """Raises ValueError naming what is wrong with the result's logprobs."""
    step = result.step_id
    for rid, lp in result.logprobs.items():
        if sampled_ids.get(rid) != lp.token_id:
            raise ValueError(f"result {step} has logprobs for {rid!r} that are not of its sampled token")
        _check_entry(step, lp, vocab_size, max_logprobs)
    for rid, outcome in result.speculation.items():  # one entry per accepted draft, of that draft
        if not (rid in result.logprobs or outcome.accepted_logprobs):
            continue
        if rid not in result.logprobs or \
                tuple(lp.token_id for lp in outcome.accepted_logprobs) != outcome.accepted_token_ids:
            raise ValueError(f"result {step} has accepted-draft logprobs for {rid!r} that are not of its "
                             "accepted drafts")
        for lp in outcome.accepted_logprobs:
            _check_entry(step, lp, vocab_size, max_logprobs)
    for rid, part in result.prompt_logprobs.items():
        if rid not in plan_ids:
            raise ValueError(f"result {step} has prompt logprobs for a request it did not run: {rid!r}")
        if part.start < 1:
            raise ValueError(f"result {step} has prompt logprobs for {rid!r} starting at position {part.start}")
        for lp in part.entries:
            _check_entry(step, lp, vocab_size, max_logprobs)


def _check_entry(step: int, lp: Logprobs, vocab_size: int | None, max_logprobs: int) -> None:
    ids = [lp.token_id, *(t for t, _ in lp.top)]
    if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
        raise ValueError(f"result {step} has logprobs of token ids outside the vocabulary")
    # a log-probability is <= 0 (a little rounding slack); NaN fails the comparison
    if len(lp.top) > max_logprobs or not all(v <= 1e-3 for v in [lp.logprob, *(v for _, v in lp.top)]):
        raise ValueError(f"result {step} has malformed logprobs (more than {max_logprobs} top entries, "
                         "NaN or positive values)")


_TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerTiming))


def check_timing(result: StepResult) -> None:
    """Worker timings feed metrics and the flight recorder: finite, non-negative seconds
    (read field by field: `dataclasses.asdict` deep-copies, every step)."""
    timing = result.timing
    for name in _TIMING_FIELDS:
        value = getattr(timing, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"result {result.step_id}: timing.{name} is {value!r}")
