"""One step under construction: the budget, what is scheduled, and the plan it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from scheduler_service.logprob_events import check_result_logprobs
from scheduler_service.request import Request
from stepahead.logprobs import MAX_LOGPROBS
from scheduler_service.speculation import check_outcomes
from stepahead.plan import NewRequest, StepPlan, StepResult, running_request


class ScheduledEntry(NamedTuple):
    """One request's part of the step under construction (a named tuple: one per running
    request per step, built with a tuple literal on the hot path)."""

    request: Request
    num_new_tokens: int
    is_new: bool  # sent in full as a NewRequest (admitted, resumed or swapped in)
    first_new_block: int  # index of the first block the worker has not seen yet
    num_drafts: int = 0  # speculative decode: drafts the worker may verify (num_new_tokens = 1 + this)


_entry = partial(tuple.__new__, ScheduledEntry)  # from one 5-tuple, no Python-level __new__


# One request's part of an in-flight plan: (request, epoch, num_tokens, samples, num_drafts).
# Stale once the request's epoch moved on (preempted / finished / aborted). A tuple: hot path.
InFlightEntry = tuple[Request, int, int, bool, int]


@dataclass(frozen=True)
class InFlightPlan:
    step_id: int
    entries: tuple[InFlightEntry, ...]
    sampling_ids: frozenset[str]  # requests whose sampled token the result must carry
    draft_allowance: dict[str, int] = field(default_factory=dict)  # speculating request -> drafts allowed

    def check_result(self, result: StepResult, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS
                     ) -> None:
        """Tokens exactly for the requests that sample (stale or failed ones may be missing),
        each inside the vocabulary; failures only for requests of this plan. A result is a
        network message: raises ValueError naming what is wrong, before anything changes."""
        tokens, failed = result.sampled_token_ids, result.failed
        extra = tokens.keys() - self.sampling_ids
        if extra:
            raise ValueError(f"result {result.step_id} has tokens for requests it did not sample: {sorted(extra)[:8]}")
        if vocab_size is not None:
            bad = [t for t in tokens.values() if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"result {result.step_id} has token ids outside the vocabulary: {bad[:8]}")
        check_outcomes(result, self.draft_allowance, vocab_size)
        if failed or result.invalid_ids:
            self._check_failed(result)
        missing = self.sampling_ids - tokens.keys() - failed.keys()
        if missing:  # only fresh entries must have a token
            missing = {req.request_id for req, epoch, *_ in self.entries if req.request_id in missing and req.epoch == epoch}
        if missing:
            raise ValueError(f"result {result.step_id} lacks sampled tokens for {sorted(missing)[:8]}")
        if result.logprobs or result.prompt_logprobs:
            check_result_logprobs(result, tokens, {req.request_id for req, *_ in self.entries}, vocab_size,
                                  max_logprobs)

    def _check_failed(self, result: StepResult) -> None:
        failed = result.failed
        both = failed.keys() & result.sampled_token_ids.keys()
        if both:
            raise ValueError(f"result {result.step_id} has both a token and a failure for {sorted(both)[:8]}")
        if not failed.keys() >= set(result.invalid_ids):
            raise ValueError(f"result {result.step_id} lists invalid requests that did not fail")
        unknown = failed.keys() - {req.request_id for req, *_ in self.entries}
        if unknown:
            raise ValueError(f"result {result.step_id} reports failures of requests it did not run: {sorted(unknown)[:8]}")


@dataclass
class StepBuilder:
    step_id: int
    token_budget: int
    seq_budget: int
    entries: dict[str, ScheduledEntry | Request] = field(default_factory=dict)  # a Request: a plain decode
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: bool = False

    def add(self, request: Request, num_new_tokens: int, is_new: bool, first_new_block: int,
            num_drafts: int = 0) -> None:
        assert num_new_tokens > num_drafts >= 0 and request.request_id not in self.entries
        self.entries[request.request_id] = _entry((request, num_new_tokens, is_new, first_new_block, num_drafts))
        self.token_budget -= num_new_tokens
        self.seq_budget -= 1
        assert self.token_budget >= 0 and self.seq_budget >= 0, "token or sequence budget overdrawn"

    def add_decode(self, request: Request) -> None:
        """`add` of a running request's plain decode: one token to sample, no new block, no
        drafts. The hot path (every running request, every step): the entry is the request."""
        self.entries[request.request_id] = request
        self.token_budget -= 1
        self.seq_budget -= 1

    def unschedule(self, request: Request) -> None:
        """Drop a running delta again (its request is being preempted)."""
        entry = self.entries.pop(request.request_id, None)
        if entry is None:
            return
        if entry is request:  # a plain decode
            self.token_budget += 1
        else:
            assert not entry.is_new, "a request admitted this step is never a victim"
            self.token_budget += entry.num_new_tokens
        self.seq_budget += 1

    def is_scheduled_new(self, request: Request) -> bool:
        entry = self.entries.get(request.request_id)
        return entry is not None and entry is not request and entry.is_new

    def build(self, finished_ids: list[str], preempted_ids: list[str]) -> tuple[StepPlan, InFlightPlan]:
        """Apply the schedule to the requests' counters and emit the plan."""
        new_reqs, running, in_flight, sampling, allowance = [], [], [], [], {}
        step_id = self.step_id
        for rid, entry in self.entries.items():
            if type(entry) is Request:  # a plain decode (add_decode): what the general case does for it
                start = entry.num_scheduled_tokens
                entry.num_scheduled_tokens = start + 1
                assert start + 1 == entry.num_tokens + entry.num_output_placeholders, "a plain decode samples"
                running.append(running_request((rid, (), 1, start >= entry.num_tokens, 0)))
                entry.num_output_placeholders += 1
                sampling.append(rid)
                entry.last_step_id = step_id
                in_flight.append((entry, entry.epoch, 1, True, 0))
                continue
            req, n, is_new, first, drafts = entry
            start = req.num_scheduled_tokens
            req.num_scheduled_tokens = end = start + n
            samples = end - drafts == req.num_tokens + req.num_output_placeholders
            if is_new:
                assert req.num_output_placeholders == 0, "a request sent in full has no placeholders"
                new_reqs.append(
                    NewRequest(
                        req.request_id, req.all_token_ids(), req.sampling, tuple(req.block_ids), start, n,
                        req.num_prompt_tokens,
                    )
                )
                req.in_worker = True
            else:
                placeholder = start >= req.num_tokens
                assert not placeholder or n - drafts == 1, "a placeholder input is always a single decode"
                blocks = req.block_ids
                running.append(running_request((req.request_id, tuple(blocks[first:]) if first < len(blocks) else (),
                                                n, placeholder, drafts)))
            if samples:
                req.num_output_placeholders += 1 + drafts  # worst case: every draft accepted
                sampling.append(req.request_id)
            if drafts:
                assert samples, "only a sampling decode speculates"
                allowance[req.request_id] = drafts
            req.last_step_id = step_id
            in_flight.append((req, req.epoch, n, samples, drafts))
        plan = StepPlan(
            step_id=step_id,
            new_requests=tuple(new_reqs),
            running=tuple(running),
            finished_ids=tuple(finished_ids),
            preempted_ids=tuple(preempted_ids),
            swap_out=tuple(self.swap_out),
            swap_in=tuple(self.swap_in),
        )
        return plan, InFlightPlan(step_id, tuple(in_flight), frozenset(sampling), allowance)
