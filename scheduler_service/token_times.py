"""When each open request last got a token: the start of its next inter-token latency (the
engine's metrics, `metrics.SchedulerMetrics`).

A step's plain tokens almost always belong to exactly the requests of the step before, in
the same order (the bulk decode path keeps them in policy order). Those requests' times are
then all one value, so they are kept as one (ids, time) pair, *the last plain step*, instead
of one dict entry each: while the next step's plain tokens are the same requests, a step
costs one list comparison, not a dict lookup and store per token. When they differ, the
pair is written into the dict first.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np


class LastTokenTimes:
    def __init__(self) -> None:
        self._times: dict[str, float] = {}
        self._ids: list[str] = []  # the last plain step's requests: their time is `_time`...
        self._time = 0.0
        self._members: set[str] | None = None  # the set of `_ids`, built when a lookup needs it
        self._moved: set[str] = set()  # ... but for these, which got another event since (in `_times`)

    def get(self, request_id: str) -> float | None:
        return self._time if self._in_overlay(request_id) else self._times.get(request_id)

    def set(self, request_id: str, when: float) -> None:
        self._leave_overlay(request_id)
        self._times[request_id] = when

    def pop(self, request_id: str) -> None:
        self._leave_overlay(request_id)
        self._times.pop(request_id, None)

    def plain_step(self, ids: list[str], now: float) -> tuple[float | np.ndarray, list[str]]:
        """A step's plain tokens at `now`: (their gaps since each one's last token: one value
        when they are the last plain step's requests, else an array, NaN for a request never
        seen; the requests never seen). They become the last plain step."""
        if ids == self._ids and not self._moved:
            gaps: float | np.ndarray = now - self._time
            unseen: list[str] = []
        else:
            self._flush()
            gaps = now - np.fromiter(map(self._times.get, ids, repeat(np.nan)), float, len(ids))
            unseen = [rid for rid, gap in zip(ids, gaps.tolist()) if gap != gap] if np.isnan(gaps).any() else []
            if unseen:  # not tracked: they stay out of the pair (never from the engine's own requests)
                skip = set(unseen)
                ids = [rid for rid in ids if rid not in skip]
        self._ids, self._time, self._members, self._moved = ids, now, None, set()
        return gaps, unseen

    def _in_overlay(self, request_id: str) -> bool:
        if not self._ids:
            return False
        if self._members is None:
            self._members = set(self._ids)
        return request_id in self._members and request_id not in self._moved

    def _leave_overlay(self, request_id: str) -> None:
        if self._in_overlay(request_id):
            self._moved.add(request_id)

    def _flush(self) -> None:
        if self._ids:
            moved = self._moved
            ids = [rid for rid in self._ids if rid not in moved] if moved else self._ids
            self._times.update(zip(ids, repeat(self._time)))
