"""Plain decodes in bulk: numpy over the running set's columns, one pass per step.

A running request's step is a *plain decode* when it computes exactly its last known token
(`remaining == 1`), the result samples one token that `max_tokens` / `max_model_len` still
allow, its input is known or is a placeholder of the previous plan, and no drafts are
allowed (speculation off). At high concurrency that is almost every running request in
every step, and these functions do its share of the step for all of them at once:

- `decode_masks`: which running requests (in policy order) take a plain decode, and which of
  those need a new block (the scheduler takes runs of them in bulk, one new block each where
  the pool has them, and decides the rest one by one);
- `build_decodes`: their counters advanced (`num_scheduled_tokens`, a placeholder,
  `last_step_id`) and their part of the plan (`RunningDeltas` columns) and of the in-flight record
  (`DecodeRun`), including decodes the scheduler gave a new block one by one;
- `commit_decodes`: a result's tokens committed for the run's fresh rows (counters and
  output lists), and which of them need a request's own look: a possible stop, a block just
  filled (the prefix cache), an event that is not plain.

Each is the bulk form of the per-request rules (`token_rules.num_new_tokens`,
`token_rules.commit_one`, `logprob_events.is_plain_commit`); `Scheduler(bulk_decodes=False)`
runs every decode through those instead, the oracle the tests compare against.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import compress

import numpy as np

from scheduler_service.request import Request
from scheduler_service.running_set import RunningColumns, RunningSet
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
    decode = (known - sched == 1) & (known < c.token_limit)
    decode &= (v.num_output_placeholders == 0) | (v.last_step_id == prev_step_id)
    rows = running.rows()
    return decode[rows], (sched >= c.block_end)[rows]


@dataclass(frozen=True, eq=False)
class DecodeRun:
    """The plain decodes of one in-flight plan: their rows, who held each row when the plan
    was built (a row whose ticket changed since is stale: its request was preempted or
    finished), and their ids in plan order."""

    columns: RunningColumns
    rows: np.ndarray
    tickets: np.ndarray
    request_ids: list[str]

    def fresh(self) -> np.ndarray:
        return self.columns.ticket[self.rows] == self.tickets

    def fresh_ids(self) -> list[str]:
        return list(compress(self.request_ids, self.fresh().tolist()))


def build_decodes(columns: RunningColumns, decodes: list[Request], block_decodes: list[tuple[Request, int]],
                  step_id: int) -> tuple[RunningDeltas, DecodeRun]:
    """Advance the counters of a plan's decodes (`decodes`: into blocks they hold;
    `block_decodes`: (request, its first block the worker has not seen)) and return their
    running deltas and in-flight record, in that order."""
    reqs = decodes + [req for req, _ in block_decodes]
    n = len(reqs)
    rows = columns.rows_of(reqs)
    v = columns.view
    start = v.num_scheduled_tokens[rows]
    placeholder = (start >= v.num_tokens[rows]).tolist()  # its input is a token not committed yet
    v.num_scheduled_tokens[rows] = start + 1
    v.num_output_placeholders[rows] += 1
    v.last_step_id[rows] = step_id
    ids = columns.request_ids[rows].tolist()
    blocks = [()] * len(decodes) + [tuple(req.block_ids[first:]) for req, first in block_decodes]
    deltas = RunningDeltas(ids, blocks, [1] * n, placeholder, [0] * n)
    return deltas, DecodeRun(columns, rows, columns.ticket[rows], ids)


@dataclass(frozen=True, eq=False)
class DecodeCommit:
    """A result applied to a run's fresh, unfailed rows (in run order): `requests` committed
    `tokens`. `plain_ids` / `plain_tokens`: those whose event is plain for sure. The others
    (`special`, indices) need their own look: `stops[i]`, its token may end it (EOS, a stop
    id, a length limit); else its first token, logprobs or prompt logprobs.
    `registrations` (indices): a block just filled with committed tokens (the prefix cache)."""

    requests: list[Request]
    tokens: list[int]
    plain_ids: list[str]
    plain_tokens: list[int]
    special: list[int]
    stops: list[bool]
    registrations: list[int]


def commit_decodes(run: DecodeRun, result: StepResult, eos_ids: tuple[int, ...], caching: bool) -> DecodeCommit:
    """Commit `result`'s tokens for the run's fresh rows (the scheduler finished those that
    failed first: their rows are stale)."""
    c, v = run.columns, run.columns.view
    live = run.fresh()
    rows, ids = run.rows, run.request_ids
    if not live.all():
        rows, ids = rows[live], list(compress(ids, live.tolist()))
    tokens = list(map(result.sampled_token_ids.__getitem__, ids))
    v.num_computed_tokens[rows] += 1
    v.num_output_placeholders[rows] -= 1
    num_tokens = v.num_tokens[rows] + 1
    v.num_tokens[rows] = num_tokens
    deque(map(list.append, c.outputs[rows].tolist(), tokens), 0)
    stops = c.stop_ids[rows] | (num_tokens >= c.token_limit[rows])
    if eos_ids:
        stops |= c.eos_stops[rows] & _is_eos(np.fromiter(tokens, np.int64, len(tokens)), eos_ids)
    plain = c.plain_ok[rows] & (num_tokens > c.num_prompt[rows] + 1) & ~stops  # not its first token
    for extra in (result.logprobs, result.prompt_logprobs):
        if extra:
            plain &= np.fromiter(map(extra.__contains__, ids), bool, len(ids)) == 0
    registrations = []
    if caching:  # a plain decode commits one token: a block fills when the committed count hits a multiple
        committed = np.minimum(v.num_computed_tokens[rows], num_tokens)
        registrations = np.flatnonzero(committed % c.block_size == 0).tolist()
    is_plain = plain.tolist()
    return DecodeCommit(c.requests[rows].tolist(), tokens, list(compress(ids, is_plain)),
                        list(compress(tokens, is_plain)), np.flatnonzero(~plain).tolist(), stops.tolist(),
                        registrations)


def _is_eos(tokens: np.ndarray, eos_ids: tuple[int, ...]) -> np.ndarray:
    out = tokens == eos_ids[0]
    for eos in eos_ids[1:]:
        out |= tokens == eos
    return out
