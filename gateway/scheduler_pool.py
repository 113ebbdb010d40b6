"""The gateway's links to every scheduler it was given, and failover between them.

A new request goes to one scheduler: the least loaded (open requests on its link) unless
the loads are within `balance_abs_threshold` of each other, in which case the prompt's
first block picks one by rendezvous hashing, so requests sharing a prefix meet the same
scheduler's prefix cache. Schedulers whose stream broke recently are skipped.

When a request's scheduler stream breaks, the request is resubmitted, same id and seed,
to another scheduler (or the same one once it is back) as prompt + the tokens already
streamed, with the remaining `max_tokens` / `min_tokens` (and no prompt logprobs once a
token was streamed: they all came with it); events after that are the continuation, with `num_prompt_tokens` restored to the client's prompt. The client sees
one continuous stream. Attempts back off exponentially, up to `failover_timeout_s`.

A scheduler without workers refuses a request as UNAVAILABLE: a fresh one (just restarted,
its workers not re-attached) at once, one whose workers all left once `--worker-wait-timeout`
passed with the request parked. With other schedulers, the request moves on to one that has
not refused it, as in a failover (prompt + the tokens streamed), and the refusing one is
skipped a while; only when every scheduler refused it does the client see the refusal.

The pool has the link's interface (`submit(msg, sink)`, `abort`, `release`): events reach
the request's sink on the links' event loop, and a failover happens there too; while every
scheduler is down its resubmission waits in a timer of that loop (the loop never sleeps, and a
scheduler's restart under a thousand open streams starts no thread).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Sequence, Set as AbstractSet

from gateway.scheduler_link import LinkBroken, SchedulerLink
from stepahead.logs import RateLimitedLog
from stepahead.v1 import scheduler_pb2

AFFINITY_TOKENS = 32  # the prompt prefix that decides affinity


class _Route:
    """One request across its submissions: what the client was sent so far, and where."""

    def __init__(self, pool: SchedulerPool, msg: scheduler_pb2.SubmitRequest, index: int,
                 sink: Callable[[object], None]) -> None:
        self.pool, self.msg, self.index, self.sink = pool, msg, index, sink
        self.streamed: list[int] = []
        self.offset = 0  # tokens streamed when the current submission was made (in its prompt)
        self.deadline: float | None = None
        self.backoff = 0.05
        self.refused: set[int] = set()  # schedulers that refused it for want of a worker

    def on_event(self, event) -> None:
        if isinstance(event, LinkBroken):
            self.pool._failover(self, event)
            return
        if type(event) is scheduler_pb2.TokenEvent and event.reject_code == scheduler_pb2.REJECT_CODE_UNAVAILABLE \
                and self.pool._redirect(self, event.message):
            return
        if self.offset and event.num_prompt_tokens >= self.offset:
            event.num_prompt_tokens -= self.offset
        self.streamed += event.token_ids
        self.sink(event)


class SchedulerPool:
    def __init__(self, links: Sequence[SchedulerLink], names: Sequence[str], log,
                 failover_timeout_s: float = 60.0, balance_abs_threshold: int = 8,
                 on_resubmit: Callable[[str], None] = lambda scheduler: None) -> None:
        """`on_resubmit(scheduler)`: a request was resubmitted to that scheduler (a metric); the
        resubmissions are logged (`request_resubmitted`) at most once per 10 s, with how many
        were not: a scheduler lost under a thousand open streams is one line, not a thousand."""
        assert links and len(links) == len(names)
        self._links, self._names = list(links), list(names)
        self._resubmitted = RateLimitedLog(log, "request_resubmitted")
        self._on_resubmit = on_resubmit
        self._down_until = [0.0] * len(links)  # monotonic: skip a link that just broke
        self._failover_timeout_s = failover_timeout_s
        self._balance = balance_abs_threshold
        self._routes: dict[str, _Route] = {}  # request id -> its route
        self._lock = threading.Lock()
        self._closing = False

    def submit(self, msg: scheduler_pb2.SubmitRequest, sink: Callable[[object], None]) -> None:
        """Like `SchedulerLink.submit`, surviving the loss of the scheduler serving it."""
        with self._lock:
            if msg.request_id in self._routes:
                raise ValueError(f"request_id {msg.request_id!r} is already in flight on this gateway")
            route = _Route(self, msg, self._choose(msg), sink)
            self._routes[msg.request_id] = route
        try:
            self._links[route.index].submit(msg, route.on_event)
        except ValueError:
            with self._lock:
                self._routes.pop(msg.request_id, None)
            raise

    def abort(self, request_id: str) -> None:
        route = self._routes.get(request_id)
        if route is not None:
            self._links[route.index].abort(request_id)

    def release(self, request_id: str) -> None:
        with self._lock:
            route = self._routes.pop(request_id, None)
        if route is not None:
            self._links[route.index].release(request_id)

    @property
    def num_open(self) -> int:
        return len(self._routes)

    def close(self) -> None:
        """Close every link (shutdown): requests still open end with `LinkBroken`, with no failover."""
        self._closing = True
        for link in self._links:
            link.close()

    def _failover(self, route: _Route, exc: LinkBroken) -> None:
        """The route's scheduler stream broke: resubmit the rest elsewhere, or give up."""
        rid = route.msg.request_id
        self._links[route.index].release(rid)
        if rid not in self._routes:
            return  # released meanwhile: the client is gone
        self._mark_down(route.index, route.backoff)
        route.deadline = route.deadline or time.monotonic() + self._failover_timeout_s
        if self._closing or time.monotonic() >= route.deadline:
            with self._lock:
                self._routes.pop(rid, None)
            route.sink(exc if self._closing else LinkBroken(
                f"{exc} (no scheduler took the request over for {self._failover_timeout_s:g} s)"))
            return
        delay = route.backoff if self._all_down() else 0.0
        route.backoff = min(route.backoff * 2, 2.0)
        if delay:
            asyncio.get_running_loop().call_later(delay, self._resubmit, route, str(exc))  # the links' loop
        else:
            self._resubmit(route, str(exc))

    def _redirect(self, route: _Route, reason: str) -> bool:
        """The route's scheduler has no worker and refused it: resubmit it to a scheduler
        that has not refused it (False, and the refusal goes to the client, when none is left)."""
        rid = route.msg.request_id
        route.refused.add(route.index)
        if rid not in self._routes or len(route.refused) == len(self._links):
            return False
        self._links[route.index].release(rid)
        self._mark_down(route.index, route.backoff)  # new requests skip it a while too
        self._resubmit(route, reason)
        return True

    def _resubmit(self, route: _Route, reason: str) -> None:
        rid = route.msg.request_id
        if rid not in self._routes:
            return
        route.index = self._choose(route.msg, exclude={route.index, *route.refused})
        route.offset = len(route.streamed)
        self._resubmitted.note(request_id=rid, reason=reason, scheduler=self._names[route.index],
                               tokens_streamed=len(route.streamed))
        self._on_resubmit(self._names[route.index])
        self._links[route.index].submit(continuation(route.msg, route.streamed), route.on_event)

    def _choose(self, msg: scheduler_pb2.SubmitRequest, exclude: AbstractSet[int] = frozenset()) -> int:
        """A scheduler for `msg`, not one of `exclude` unless every one is excluded."""
        now = time.monotonic()
        candidates = [i for i in range(len(self._links)) if i not in exclude and self._down_until[i] <= now]
        if not candidates:  # every other one is down (or there is only one): try them all
            candidates = [i for i in range(len(self._links)) if i not in exclude] or sorted(exclude)
        loads = {i: self._links[i].num_open for i in candidates}
        if max(loads.values()) - min(loads.values()) > self._balance:
            return min(candidates, key=lambda i: loads[i])
        prefix = bytes(str(list(msg.prompt_token_ids[:AFFINITY_TOKENS])), "ascii")
        return max(candidates, key=lambda i: hashlib.blake2b(prefix + self._names[i].encode(), digest_size=8).digest())

    def _mark_down(self, index: int, for_s: float) -> None:
        self._down_until[index] = max(self._down_until[index], time.monotonic() + for_s)

    def _all_down(self) -> bool:
        now = time.monotonic()
        return all(d > now for d in self._down_until)


def continuation(msg: scheduler_pb2.SubmitRequest, streamed: Sequence[int]) -> scheduler_pb2.SubmitRequest:
    """The request as a new submission that continues after `streamed`: prompt + streamed
    tokens, the remaining max_tokens / min_tokens, the same id and seed."""
    out = scheduler_pb2.SubmitRequest()
    out.CopyFrom(msg)
    out.prompt_token_ids.extend(streamed)
    if msg.sampling.HasField("max_tokens"):
        out.sampling.max_tokens = msg.sampling.max_tokens - len(streamed)
    out.sampling.min_tokens = max(0, msg.sampling.min_tokens - len(streamed))
    if streamed:  # the first token came with the last prompt logprobs: never ask for them again
        out.sampling.ClearField("prompt_logprobs")
    return out
