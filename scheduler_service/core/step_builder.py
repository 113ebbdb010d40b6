"""One step under construction: the budget, what is scheduled, and the plan it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import numpy as np

from scheduler_service.core.decodes import DecodeRun, ScheduledDecodes
from scheduler_service.core.request import Request
from scheduler_service.core.running_set import RunningColumns
from scheduler_service.core.token_rules import placeholder_input
from stepahead.plan import GrammarPrep, KVLoad, NewRequest, RunningDeltas, StepPlan, running_request


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
    entries: tuple[InFlightEntry, ...]  # every request but the plain decodes
    sampling: list[str]  # requests whose sampled token the result must carry, in the plan's order
    draft_allowance: dict[str, int] = field(default_factory=dict)  # speculating request -> drafts allowed
    decodes: DecodeRun | None = None  # the plan's decodes (each samples one token)

    def fresh_ids(self) -> set[str]:
        """The requests of this plan still in the state the plan saw (not preempted, finished or aborted since)."""
        fresh = {req.request_id for req, epoch, *_ in self.entries if req.epoch == epoch}
        return fresh.union(self.decodes.fresh_ids()) if self.decodes is not None else fresh

    def plan_ids(self) -> set[str]:
        """Every request of this plan."""
        ids = {req.request_id for req, *_ in self.entries}
        return ids.union(self.decodes.request_ids) if self.decodes is not None else ids

@dataclass
class StepBuilder:
    step_id: int
    token_budget: int
    seq_budget: int
    entries: dict[str, ScheduledEntry] = field(default_factory=dict)  # every request but the decodes
    decodes: ScheduledDecodes = field(default_factory=ScheduledDecodes)  # in policy order
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    grammars: list[GrammarPrep] = field(default_factory=list)
    preempted: bool = False

    def add(self, request: Request, num_new_tokens: int, is_new: bool, first_new_block: int,
            num_drafts: int = 0) -> None:
        assert num_new_tokens > num_drafts >= 0 and request.request_id not in self.entries
        self.entries[request.request_id] = _entry((request, num_new_tokens, is_new, first_new_block, num_drafts))
        self.token_budget -= num_new_tokens
        self.seq_budget -= 1
        assert self.token_budget >= 0 and self.seq_budget >= 0, "token or sequence budget overdrawn"

    def add_decodes(self, rows: np.ndarray, grown: list[tuple[int, Request, int]] = ()) -> None:
        """Running requests' plain decodes (one token to sample, no drafts), by running row, in
        bulk: the hot path, every running request every step. `grown`: (index in `rows`,
        request, its first block the worker has not seen) of those given a block just now."""
        self.decodes.add(rows, grown)
        self.token_budget -= len(rows)
        self.seq_budget -= len(rows)
        assert self.token_budget >= 0 and self.seq_budget >= 0, "token or sequence budget overdrawn"

    def add_decode(self, request: Request, first_new_block: int) -> None:
        """One running request's decode, into blocks of its table from `first_new_block` on."""
        grown = [(0, request, first_new_block)] if first_new_block < len(request.block_ids) else []
        self.add_decodes(np.array([request.running_row]), grown)

    def unschedule(self, request: Request) -> None:
        """Drop a running request from the step again (it is being preempted: the tail of the
        running order, so a decode of it, if any, is almost always the last one added)."""
        entry = self.entries.pop(request.request_id, None)
        if entry is not None:
            assert not entry.is_new, "a request admitted this step is never a victim"
            self.token_budget += entry.num_new_tokens
        elif self.decodes.remove(request):
            self.token_budget += 1
        else:
            return  # not scheduled in this step
        self.seq_budget += 1

    @property
    def is_empty(self) -> bool:
        return not (self.entries or self.decodes or self.swap_out or self.swap_in or self.kv_loads or self.grammars)

    def is_scheduled_new(self, request: Request) -> bool:
        entry = self.entries.get(request.request_id)
        return entry is not None and entry.is_new

    def build(self, finished_ids: list[str], preempted_ids: list[str], columns: RunningColumns
              ) -> tuple[StepPlan, InFlightPlan]:
        """Apply the schedule to the requests' counters and emit the plan."""
        new_reqs, running, in_flight, allowance = [], [], [], {}
        sampling_new, sampling_running = [], []  # in the order the worker reports them: new, then running
        step_id = self.step_id
        for entry in self.entries.values():
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
                placeholder = placeholder_input(start, req.num_tokens)
                assert not placeholder or n - drafts == 1, "a placeholder input is always a single decode"
                blocks = req.block_ids
                running.append(running_request((req.request_id, tuple(blocks[first:]) if first < len(blocks) else (),
                                                n, placeholder, drafts)))
            if samples:
                req.num_output_placeholders += 1 + drafts  # worst case: every draft accepted
                (sampling_new if is_new else sampling_running).append(req.request_id)
            if drafts:
                assert samples, "only a sampling decode speculates"
                allowance[req.request_id] = drafts
            req.last_step_id = step_id
            in_flight.append((req, req.epoch, n, samples, drafts))
        deltas, decodes, sampling = RunningDeltas.of(running), None, sampling_new + sampling_running
        if self.decodes:
            decode_deltas, decodes = self.decodes.build(columns, step_id)
            deltas = deltas.followed_by(decode_deltas) if running else decode_deltas
            sampling += decodes.request_ids
        plan = StepPlan(
            step_id=step_id,
            new_requests=tuple(new_reqs),
            running=deltas,
            finished_ids=tuple(finished_ids),
            preempted_ids=tuple(preempted_ids),
            swap_out=tuple(self.swap_out),
            swap_in=tuple(self.swap_in),
            kv_loads=tuple(self.kv_loads),
            grammars=tuple(self.grammars),
        )
        return plan, InFlightPlan(step_id, tuple(in_flight), sampling, allowance, decodes)
