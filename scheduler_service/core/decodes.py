"""Plain decodes in bulk: numpy over the running set's columns, one pass per step.

A running request's step is a *plain decode* when it computes exactly its last known token
(`remaining == 1`), the result samples one token that `max_tokens` / `max_model_len` still
allow, its input is known or is a placeholder of the previous plan, and no drafts are
allowed (speculation off). At high concurrency that is almost every running request in
every step, and these functions do its share of the step for all of them at once:

- `decode_masks`: which running requests (in policy order) take a plain decode, and which of
  those need a new block (the scheduler takes runs of them in bulk, one new block each where
  the pool has them, and decides the rest one by one);
- `ScheduledDecodes`: a step's decodes in policy order; `build` advances their counters
  (`num_scheduled_tokens`, a placeholder, `last_step_id`) and makes their part of the plan
  (`RunningDeltas` columns) and of the in-flight record (`DecodeRun`);
- `commit_decodes`: a result's tokens committed for the run's fresh rows (counters and
  output lists), and which of them need a request's own look: a possible stop, a block just
  filled (the prefix cache), an event that is not plain.

Each is the bulk form of the per-request rules (`token_rules.num_new_tokens`,
`token_rules.commit_one`, `logprob_events.is_plain_commit`), and takes the rules both share
from `token_rules` (the length rule `token_limit`, through the running set's columns;
`placeholder_input`; `waits_for_older_plan`), applied to columns. The tests' lockstep
oracle (tests/unit/per_request_scheduler.py) runs every decode through the per-request forms.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import compress

import numpy as np

from scheduler_service.core.request import Request
from scheduler_service.core.running_set import RunningColumns, RunningSet
from scheduler_service.core.token_rules import placeholder_input, waits_for_older_plan
from stepahead.plan import RunningDeltas, StepResult


def decode_masks(running: RunningSet, prev_step_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per running request (policy order): whether its step is a plain decode, and whether
    that decode needs a new block (its blocks are full: exactly one more). `prev_step_id`:
    the plan before the one being built (a placeholder input must come from it: the worker
    keeps only the previous step's sampled ids)."""
    c = running.columns
    v = c.view
    known = v.num_tokens + v.num_output_placeholders  # every row at once: cheaper than gathering
    sched = v.num_scheduled_tokens
    decode = (known - sched == 1) & (known < c.token_limit)  # one token left to compute, and it may sample
    decode &= ~waits_for_older_plan(v.num_output_placeholders, v.last_step_id, prev_step_id)
    rows = running.rows()
    return decode[rows], (sched >= c.block_end)[rows]


@dataclass(frozen=True, eq=False)
class DecodeRun:
    """The plain decodes of one in-flight plan: their rows, who held each row when the plan
    was built (a row whose ticket changed since is stale: its request was preempted or
    finished), their ids in plan order, and the columns' departures then (while no request
    left a row since, none is stale)."""

    columns: RunningColumns
    rows: np.ndarray
    tickets: np.ndarray
    request_ids: list[str]
    departures: int

    def fresh(self) -> np.ndarray | None:
        """bool per row: still held by its request (None: all are)."""
        if self.columns.departures == self.departures:
            return None
        fresh = self.columns.ticket[self.rows] == self.tickets
        return None if fresh.all() else fresh

    def fresh_ids(self) -> list[str]:
        fresh = self.fresh()
        return self.request_ids if fresh is None else list(compress(self.request_ids, fresh.tolist()))


class ScheduledDecodes:
    """The decodes of the step under construction, in policy order: chunks of running rows,
    and those whose blocks were full (`grown`: their index among the decodes, the request,
    its first block the worker has not seen). The same order every step while the running
    set stays: the plan's deltas, the result and the step's plain tokens list the same ids."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.grown: list[tuple[int, Request, int]] = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, rows: np.ndarray, grown: list[tuple[int, Request, int]] = ()) -> None:
        """Decodes of these running rows; `grown`: (index in `rows`, request, first new block)."""
        if len(rows):
            self.grown += [(self.count + i, req, first) for i, req, first in grown]
            self.chunks.append(rows)
            self.count += len(rows)

    def remove(self, request: Request) -> bool:
        """Drop a decode of `request` (preempted in the same step); False when it has none."""
        row = request.running_row
        if row < 0 or not any((chunk == row).any() for chunk in self.chunks):
            return False
        rows = np.concatenate(self.chunks)
        at = int(np.flatnonzero(rows == row)[0])
        self.chunks = [np.delete(rows, at)] if len(rows) > 1 else []
        self.grown = [(i - (i > at), req, first) for i, req, first in self.grown if req is not request]
        self.count -= 1
        return True

    def build(self, columns: RunningColumns, step_id: int) -> tuple[RunningDeltas, DecodeRun]:
        """Advance the decodes' counters; their running deltas and in-flight record."""
        rows = np.concatenate(self.chunks)
        n = len(rows)
        v = columns.view
        start = v.num_scheduled_tokens[rows]
        placeholder = placeholder_input(start, v.num_tokens[rows]).tolist()
        v.num_scheduled_tokens[rows] = start + 1
        v.num_output_placeholders[rows] += 1
        v.last_step_id[rows] = step_id
        ids = columns.request_ids[rows].tolist()
        blocks, counts = [()] * n, [0] * n
        for i, req, first in self.grown:
            blocks[i] = tuple(req.block_ids[first:])
            counts[i] = len(blocks[i])
        deltas = RunningDeltas(ids, blocks, [1] * n, placeholder, [0] * n, counts)
        return deltas, DecodeRun(columns, rows, columns.ticket[rows], ids, columns.departures)


@dataclass(frozen=True, eq=False)
class DecodeCommit:
    """A result applied to a run's fresh rows: `plain_ids` / `plain_tokens`, the requests
    whose event is plain for sure and their tokens. `special`: (request, token, may stop) of
    the others, which need their own look: its token may end it (EOS, a stop id, a length
    limit), or it is its first token, or has logprobs or prompt logprobs. `registrations`: the
    requests that just filled a block with committed tokens (the prefix cache)."""

    plain_ids: list[str]
    plain_tokens: list[int]
    special: list[tuple[Request, int, bool]]
    registrations: list[Request]


def commit_decodes(run: DecodeRun, result: StepResult, tokens: list[int] | None, eos: frozenset[int],
                   caching: bool) -> DecodeCommit:
    """Commit `result`'s tokens for the run's fresh rows (the scheduler finished those that
    failed first: their rows are stale). `tokens`: one per row of the run, in order, when the
    result lists them so (else they are looked up by id)."""
    c, v = run.columns, run.columns.view
    rows, ids = run.rows, run.request_ids
    live = run.fresh()
    if live is not None:
        fresh = live.tolist()
        rows, ids = rows[live], list(compress(ids, fresh))
        tokens = list(compress(tokens, fresh)) if tokens is not None else None
    if tokens is None:
        tokens = list(map(result.sampled_token_ids.__getitem__, ids))
    v.num_computed_tokens[rows] += 1
    v.num_output_placeholders[rows] -= 1
    num_tokens = v.num_tokens[rows] + 1
    v.num_tokens[rows] = num_tokens
    deque(map(list.append, c.outputs[rows].tolist(), tokens), 0)
    stops = num_tokens >= c.stop_at[rows]
    if not eos.isdisjoint(tokens):  # an EOS id among them (rare but for ignore_eos): those rows may stop
        hits = [i for i, token in enumerate(tokens) if token in eos]
        stops[hits] |= c.eos_stops[rows[hits]]
    plain = (num_tokens >= c.plain_from[rows]) & ~stops
    for extra in (result.logprobs, result.prompt_logprobs):
        if extra:
            plain &= np.fromiter(map(extra.__contains__, ids), bool, len(ids)) == 0
    registrations = []
    if caching:  # a plain decode commits one token: a block fills when the committed count hits a multiple
        committed = np.minimum(v.num_computed_tokens[rows], num_tokens)
        registrations = c.requests[rows[committed % c.block_size == 0]].tolist()
    special = np.flatnonzero(~plain).tolist()
    if not special:
        return DecodeCommit(ids, tokens, [], registrations)
    is_plain = plain.tolist()
    return DecodeCommit(list(compress(ids, is_plain)), list(compress(tokens, is_plain)),
                        [(c.requests[rows[i]], tokens[i], bool(stops[i])) for i in special], registrations)
