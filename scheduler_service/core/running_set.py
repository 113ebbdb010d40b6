"""The running requests of one scheduler core, in policy order, with their per-step counters
in columns.

Almost every step advances almost every running request by one plain decode: one token
scheduled, one placeholder, one token committed. Done on each `Request` object that is
Python work per request per step, the largest part of the scheduler's CPU at high
concurrency. While a request runs, its counters (`request.COLUMN_COUNTERS`) live in one row
of `RunningColumns` instead: the `Request` attributes of those names read and write that
row (every reader sees the same values, running or not), and the bulk decode path
(`decodes.py`) reads and advances many rows with a few numpy operations.

Each counter column is an `array('q')` (a `Request` attribute is one C-level index into it)
with a numpy view over the same memory (`RunningColumns.view`). The set has `max_num_seqs`
rows, the most requests a core runs at once, so the arrays never grow and the views stay
valid. A request's values move into its row when it starts running (`insert`) and back onto
the object when it stops (`remove`): admission, swap-in, preemption and finishing, the
scheduler's named status transitions.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Iterator
from operator import attrgetter
from types import SimpleNamespace

import numpy as np

from scheduler_service.core.request import COLUMN_COUNTERS, Request
from scheduler_service.core.logprob_events import plain_from
from scheduler_service.core.token_rules import may_stop_at, schedule_limit

_run_key = attrgetter("run_key")  # the policy's order of running requests
_row_of = attrgetter("_row")


class RunningColumns:
    """One row per running request: the `COLUMN_COUNTERS` (array('q'), plus `view.<name>`: the
    same memory as a numpy int64 array) and what the bulk decode path needs to know of each
    request, set when it starts running (none of it changes while it runs, but for
    `block_end`, which follows `Request.block_ids`)."""

    def __init__(self, capacity: int, block_size: int, max_model_len: int) -> None:
        self.capacity, self.block_size, self.max_model_len = capacity, block_size, max_model_len
        for name in COLUMN_COUNTERS:
            setattr(self, name, array("q", bytes(8 * capacity)))
        self.view = SimpleNamespace(**{n: np.frombuffer(getattr(self, n), dtype=np.int64) for n in COLUMN_COUNTERS})
        self.block_end = np.zeros(capacity, np.int64)  # len(block_ids) * block_size: the tokens its blocks hold
        self.token_limit = np.zeros(capacity, np.int64)  # token_rules.schedule_limit: known tokens stay below it
        # token_rules.may_stop_at: from there a committed token may end it; an EOS id is checked
        # apart, where `eos_stops`
        self.stop_at = np.zeros(capacity, np.int64)
        self.eos_stops = np.zeros(capacity, bool)  # an EOS id ends it (not ignore_eos)
        # logprob_events.plain_from: from there its committed tokens may be plain events
        self.plain_from = np.zeros(capacity, np.int64)
        # who holds the row (0: nobody): an in-flight row whose ticket changed since is stale
        self.ticket = np.zeros(capacity, np.int64)
        self.departures = 0  # requests that left a row so far: while unchanged, no in-flight row is stale
        self.requests = np.empty(capacity, object)
        self.request_ids = np.empty(capacity, object)
        self.outputs = np.empty(capacity, object)  # each request's output_token_ids list (appended in bulk)
        self._free = list(range(capacity - 1, -1, -1))
        self._tickets = itertools.count(1)

    def attach(self, req: Request) -> None:
        """Give `req` a row and move its counters there."""
        if not self._free:
            raise RuntimeError(f"more than {self.capacity} requests running (max_num_seqs)")
        row = self._free.pop()
        for name in COLUMN_COUNTERS:
            getattr(self, name)[row] = getattr(req, name)
        sp = req.sampling
        self.block_end[row] = len(req.block_ids) * self.block_size
        self.token_limit[row] = schedule_limit(req, self.max_model_len)
        self.stop_at[row] = may_stop_at(req, self.max_model_len)
        self.eos_stops[row] = not sp.ignore_eos
        self.plain_from[row] = plain_from(req)
        self.ticket[row] = next(self._tickets)
        self.requests[row], self.request_ids[row], self.outputs[row] = req, req.request_id, req.output_token_ids
        req._columns, req._row = self, row

    def detach(self, req: Request) -> None:
        """Move `req`'s counters back onto it and free its row."""
        row = req._row
        assert self.requests[row] is req, f"{req.request_id} does not hold row {row}"
        values = [getattr(self, name)[row] for name in COLUMN_COUNTERS]
        req._columns, req._row = None, -1
        for name, value in zip(COLUMN_COUNTERS, values):
            setattr(req, name, value)
        self.ticket[row] = 0
        self.departures += 1
        self.requests[row] = self.request_ids[row] = self.outputs[row] = None
        self._free.append(row)

    def rows_of(self, reqs: list[Request]) -> np.ndarray:
        """The rows of running requests, in the given order."""
        return np.fromiter(map(_row_of, reqs), np.intp, len(reqs))

    def blocks_changed(self, row: int, num_blocks: int) -> None:
        self.block_end[row] = num_blocks * self.block_size

    def check(self, req: Request) -> None:
        """The row's copies of the request's own state (integrity checks)."""
        row = req._row
        if not (self.requests[row] is req and self.ticket[row] > 0
                and self.block_end[row] == len(req.block_ids) * self.block_size
                and self.outputs[row] is req.output_token_ids):
            raise AssertionError(f"{req!r}: its running row {row} is out of step with it")


class RunningSet:
    """The running requests in policy order (`Request.run_key`, fixed when a request starts
    running), each holding a row of `columns` while it is here."""

    def __init__(self, capacity: int, block_size: int, max_model_len: int) -> None:
        self.columns = RunningColumns(capacity, block_size, max_model_len)
        self._order: list[Request] = []
        self._rows: np.ndarray | None = None  # the rows in policy order; None: rebuild (membership changed)

    def insert(self, req: Request) -> None:
        self.columns.attach(req)
        bisect.insort(self._order, req, key=_run_key)
        self._rows = None

    def remove(self, req: Request) -> None:
        self._order.remove(req)
        self.columns.detach(req)
        self._rows = None

    def rows(self) -> np.ndarray:
        """Each running request's row, in policy order."""
        if self._rows is None:
            self._rows = self.columns.rows_of(self._order)
        return self._rows

    def check(self) -> None:
        """Each running request holds its row, nothing else holds one (integrity checks)."""
        c = self.columns
        for req in self._order:
            c.check(req)
        if np.count_nonzero(c.ticket) != len(self._order) or len(c._free) + len(self._order) != c.capacity:
            raise AssertionError(f"{np.count_nonzero(c.ticket)} running rows held, {len(self._order)} running")
        if self._rows is not None and self._rows.tolist() != [req._row for req in self._order]:
            raise AssertionError("the running rows are out of step with the running order")

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, index):
        return self._order[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._order)

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._order)
