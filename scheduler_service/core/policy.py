"""Queue policies behind one interface, and the waiting queue they order.

A policy gives every request a sort key (lower = served first). The waiting queue is a
heap on the policy's static key; running requests are re-sorted each step with
`running_key`, and preemption victims come from the worst end.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable

from scheduler_service.core.config import SchedulerConfig, SchedulingPolicy
from scheduler_service.core.request import Request


class QueuePolicy(ABC):
    has_aging = False
    ttft_target = 0.0  # > 0: requests waiting for their first token become urgent (`urgent_key`)
    urgent_after = 0.0  # ... once they have waited this long since arrival, until ttft_target
    can_preempt_running = False  # may a waiting request preempt running ones?

    @abstractmethod
    def static_key(self, request: Request) -> tuple:
        """Order of waiting requests that does not depend on the time."""

    def running_key(self, request: Request, now: float) -> tuple:
        """Order of running requests (victims come from the worst end)."""
        return self.static_key(request)

    def queue_key(self, request: Request, now: float) -> tuple:
        """Order in which waiting requests are admitted at time `now`."""
        return self.static_key(request)

    def may_preempt(self, candidate: Request, victim: Request, now: float) -> bool:
        """May the waiting `candidate` preempt the running `victim` to get admitted?"""
        return False

    def is_aged(self, request: Request, now: float) -> bool:
        return False

    def ahead_of(self, priority: int, waiting: Counter) -> int:
        """Waiting requests (`waiting`: how many of each priority) served before a new request
        of `priority` (admission control's model, `admission.ExpectedWait`): those of its
        priority or better."""
        return sum(n for p, n in waiting.items() if p <= priority)

    def urgent_key(self, request: Request) -> tuple:
        """Order of urgent waiting requests (comparable with `static_key`)."""
        return self.static_key(request)

    def late_key(self, request: Request) -> tuple:
        """Order of waiting requests past the TTFT target (comparable with `static_key`)."""
        return self.static_key(request)

    def is_urgent(self, request: Request, now: float) -> bool:
        """Has `request` no token yet and waited past `urgent_after`, but not past `ttft_target`?"""
        return (self.ttft_target > 0 and not request.num_output_tokens
                and self.urgent_after <= now - request.arrival_time < self.ttft_target)

    def is_late(self, request: Request, now: float) -> bool:
        """Has `request` no token yet and waited past `ttft_target` (when set)?"""
        return self.ttft_target > 0 and not request.num_output_tokens and now - request.arrival_time >= self.ttft_target

    def pick_victim(self, candidate: Request, worst_first: Iterable[Request], now: float) -> Request | None:
        """The running request (given worst first) that the waiting `candidate` preempts to
        get admitted, or None: the worst one, if the candidate may preempt it."""
        victim = next(iter(worst_first), None)
        return victim if victim is not None and self.may_preempt(candidate, victim, now) else None


class FcfsPolicy(QueuePolicy):
    def static_key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def ahead_of(self, priority: int, waiting: Counter) -> int:
        return sum(waiting.values())


class PriorityPolicy(QueuePolicy):
    """Lower priority value first, ties by arrival; strictly better may preempt worse."""

    can_preempt_running = True

    def static_key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)

    def may_preempt(self, candidate: Request, victim: Request, now: float) -> bool:
        return candidate.priority < victim.priority


class ScorePolicy(QueuePolicy):
    """Priority first; within a priority, score = w_l * remaining tokens - w_w * time since
    arrival (lowest first); a preempted stream is readmitted before any new request.

    Priority dominates: no request of a worse priority goes ahead of a waiting better one
    (unless it has aged, below), however long it waited or however short it is. (A summed
    priority term let long priority-0 prompts, whose length term outweighed two levels, wait
    until they became urgent while short priority-2 requests went first: priority 0's TTFT
    tail grew several-fold under overload, `benchmarks/policies.py`.) Starvation of the worse
    classes is bounded by aging, and with admission control on (`max_expected_wait`) by
    shedding the request at the bound instead (`Scheduler._shed_overdue`).

    Within a priority, 1000 remaining tokens are worth 5 s of waiting (w_l / w_w, defaults):
    short requests go first, but a long one is passed over by same-priority arrivals of at
    most the next few seconds.

    Readmission: a preempted request that has streamed tokens (its client is waiting in the
    middle of a stream: every second it waits again is TPOT) goes ahead of every request
    that has not, in the order they were preempted; the running order ranks it there too, so
    it is not a victim again before every request admitted without such a turn. (Queued
    behind new requests of its class, preempted streams made the TPOT tail under overload.)

    With a TTFT target (`score_ttft_target` > 0), a request that has no token yet and has
    waited (since arrival) past half the target but not past the target is urgent: its
    length term no longer counts, so among the requests of its priority about to miss the
    target the oldest goes first and shorter, later arrivals of its priority no longer pass
    it; a request past the target cannot meet it and is ordered by its score again. (Without
    it, on `benchmarks/policies.py`'s seed-1 trace at 1.0x load, long priority-2 prompts were
    passed over by many later, shorter priority-2 requests each and missed the target.)

    The wait term is `w_w * (now - arrival)`; `-w_w * now` is common to all requests, so
    the order is static: `(priority, w_l * remaining + w_w * arrival)`. A request that
    has been in the waiting queue longer than `max_wait_time` (since it arrived or was last
    preempted) has aged: it goes ahead of every request that has not, aged requests go in
    queueing order, and an aged request may preempt any running request but one that was
    itself admitted aged (its aged turn: the running key records it). So nobody starves: a
    preempted request ages again after `max_wait_time` and takes its turn, and keeps it.
    (When aged requests could preempt one another, deep overload, where nearly every
    waiting request has aged, livelocked: each aged admission threw out a request still in
    its re-prefill, which aged again and did the same, and no request ever got its next
    token: `tests/sim/test_overload_progress.py`.)
    """

    has_aging = True
    can_preempt_running = True

    def __init__(self, config: SchedulerConfig) -> None:
        self.w_wait = config.score_wait_weight
        self.w_length = config.score_length_weight
        self.max_wait = config.max_wait_time
        self.ttft_target = config.score_ttft_target
        self.urgent_after = self.ttft_target / 2

    def score(self, request: Request) -> float:
        """Within a priority: lower first."""
        remaining = (
            request.num_tokens - request.num_computed_tokens
            + request.sampling.max_tokens - request.num_output_tokens
        )
        return self.w_length * remaining + self.w_wait * request.arrival_time

    def static_key(self, request: Request) -> tuple:
        """Aged requests are tier 0 (`queue_key`), preempted streams tier 1 in queueing order,
        every other request tier 2 by priority, then score."""
        if request.num_output_tokens:
            return (1, request.queued_time, request.arrival_time)
        return (2, request.priority, 0, self.score(request), request.arrival_time)

    def is_aged(self, request: Request, now: float) -> bool:
        return now - request.queued_time > self.max_wait

    def running_key(self, request: Request, now: float) -> tuple:
        """The static key, then whether it is admitted on its aged turn (`_had_aged_turn`)."""
        return (*self.static_key(request), self.is_aged(request, now))

    def urgent_key(self, request: Request) -> tuple:
        return (2, request.priority, 0, self.w_wait * request.arrival_time, request.arrival_time)

    def late_key(self, request: Request) -> tuple:
        return (2, request.priority, 1, self.score(request), request.arrival_time)

    def queue_key(self, request: Request, now: float) -> tuple:
        if self.is_aged(request, now):
            return (0, request.queued_time, request.arrival_time)
        if self.is_urgent(request, now):
            return self.urgent_key(request)
        if self.is_late(request, now):
            return self.late_key(request)
        return self.static_key(request)

    def may_preempt(self, candidate: Request, victim: Request, now: float) -> bool:
        """An aged request preempts anything but a request on its own aged turn. Otherwise a
        strictly better priority preempts worse running work, but each victim only once: a
        request preempted before can then only lose its place to an aged request, and not
        once it runs on its aged turn, so it finishes (no starvation by preemption, and no
        preempt / readmit cycle among aged requests)."""
        return ((self.is_aged(candidate, now) and not _had_aged_turn(victim))
                or _outranks(candidate.priority, victim))

    def pick_victim(self, candidate: Request, worst_first: Iterable[Request], now: float) -> Request | None:
        """Among the running requests the candidate may preempt (not only the worst one: a
        protected, once-preempted tail must not leave the candidate waiting for a slot), those
        of the worst priority; of these the worst-scored one that has streamed its first token
        (its TTFT is met: preemption stalls its stream for a while, spread over its TPOT),
        else the worst-scored one (one still before its first token pays the wait in TTFT)."""
        aged, priority = self.is_aged(candidate, now), candidate.priority
        # may_preempt, inlined (hot): run_key[-1] is `_had_aged_turn`
        eligible = [v for v in worst_first if (aged and not v.run_key[-1]) or _outranks(priority, v)]
        if not eligible:
            return None
        worst = max(v.priority for v in eligible)
        eligible = [v for v in eligible if v.priority == worst]
        return next((v for v in eligible if v.num_output_tokens), eligible[0])


def _had_aged_turn(victim: Request) -> bool:
    """Was the running (or swapped) `victim` admitted on its aged turn? Then no aged request
    preempts it: aged requests take their turns in queueing order and keep them."""
    return victim.run_key[-1]


def _outranks(priority: int, victim: Request) -> bool:
    """The score policy's preemption right of a request that has not aged: a strictly better
    priority, and a victim never preempted before."""
    return priority < victim.priority and not victim.num_preemptions


def make_policy(config: SchedulerConfig) -> QueuePolicy:
    match config.scheduling_policy:
        case SchedulingPolicy.FCFS:
            return FcfsPolicy()
        case SchedulingPolicy.PRIORITY:
            return PriorityPolicy()
        case SchedulingPolicy.SCORE:
            return ScorePolicy(config)
    raise ValueError(f"unknown scheduling policy {config.scheduling_policy!r}")


_QUEUE_TOKENS = itertools.count()  # every queue entry's token, unique in the process


class WaitingQueue:
    """Heaps with lazy removal (an entry is live while its token is its request's
    `queue_token`). Every request waits in a heap on the policy's static key, except, with a
    TTFT target, one without a token: it moves (a new token) from the static-key heap to a
    heap on the urgent key once it has waited past `urgent_after` since arrival, and from
    there to a heap on the late key once past the target (heaps by arrival time tell when).
    `peek` takes the least key of the heaps' heads; for aging policies a heap on queueing
    time finds the longest-waiting request, which goes first once it has aged."""

    def __init__(self, policy: QueuePolicy) -> None:
        self._policy = policy
        self._by_key: list[tuple] = []
        self._by_queued: list[tuple] = []
        self._to_urgent: list[tuple] = []  # requests in `_by_key` with no token yet, by arrival
        self._urgent: list[tuple] = []  # by the urgent key
        self._to_late: list[tuple] = []  # requests in `_urgent`, by arrival
        self._late: list[tuple] = []  # by the late key
        self._tokens = _QUEUE_TOKENS  # shared: a request that moved between cores (a hand-off,
        # a lost replica) leaves stale entries in its old queue, which must never read as live
        self._live: dict[str, Request] = {}
        self.by_priority: Counter = Counter()  # waiting requests of each priority

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.queue_token is not None

    def push(self, request: Request) -> None:
        assert request.queue_token is None, f"{request.request_id} queued twice"
        token = self._retoken(request)
        heapq.heappush(self._by_key, (self._policy.static_key(request), token, request))
        if self._policy.ttft_target and not request.num_output_tokens:
            heapq.heappush(self._to_urgent, (request.arrival_time, token, request))
        self._live[request.request_id] = request
        self.by_priority[request.priority] += 1

    def remove(self, request: Request) -> None:
        assert request.queue_token is not None, f"{request.request_id} is not queued"
        request.queue_token = None
        del self._live[request.request_id]
        self.by_priority[request.priority] -= 1

    def peek(self, now: float) -> Request | None:
        if self._policy.has_aging:
            oldest = self._top(self._by_queued)
            if oldest is not None and self._policy.is_aged(oldest, now):
                return oldest
        if not self._policy.ttft_target:
            return self._top(self._by_key)
        self._advance(now)
        return self._least((self._by_key, self._urgent, self._late))

    def pop(self, now: float) -> Request | None:
        request = self.peek(now)
        if request is not None:
            self.remove(request)
        return request

    def requests(self) -> list[Request]:
        return list(self._live.values())

    def oldest(self) -> Request | None:
        """The request longest in the queue (aging policies only; None otherwise or if empty)."""
        return self._top(self._by_queued)

    def _retoken(self, request: Request) -> int:
        """A new live token (earlier entries of the request die), in the queueing-time heap too."""
        token = next(self._tokens)
        request.queue_token = token
        if self._policy.has_aging:
            heapq.heappush(self._by_queued, ((request.queued_time, request.arrival_time), token, request))
        return token

    def _advance(self, now: float) -> None:
        """Move the requests that waited past `urgent_after` (since arrival) to the urgent heap,
        and those past the TTFT target on to the late heap."""
        policy = self._policy
        while (r := self._top(self._to_urgent)) is not None and now - r.arrival_time >= policy.urgent_after:
            heapq.heappop(self._to_urgent)
            token = self._retoken(r)
            heapq.heappush(self._urgent, (policy.urgent_key(r), token, r))
            heapq.heappush(self._to_late, (r.arrival_time, token, r))
        while (r := self._top(self._to_late)) is not None and now - r.arrival_time >= policy.ttft_target:
            heapq.heappop(self._to_late)
            heapq.heappush(self._late, (policy.late_key(r), self._retoken(r), r))

    def _least(self, heaps: tuple[list[tuple], ...]) -> Request | None:
        """The request at the head with the least key among `heaps`."""
        best = None
        for heap in heaps:
            if self._top(heap) is not None and (best is None or heap[0][0] < best[0]):
                best = heap[0]
        return best[2] if best is not None else None

    @staticmethod
    def _top(heap: list[tuple]) -> Request | None:
        while heap and heap[0][2].queue_token != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None
