"""The gateway's links to every scheduler it was given, and failover between them.

A new request goes to one scheduler: the least loaded (open requests on its link) unless
the loads are within `balance_abs_threshold` of each other, in which case the prompt's
first block picks one by rendezvous hashing, so requests sharing a prefix meet the same
scheduler's prefix cache. Schedulers whose stream broke recently are skipped.

When a request's scheduler stream breaks, the request is resubmitted, same id and seed,
to another scheduler (or the same one once it is back) as prompt + the tokens already
streamed, with the remaining `max_tokens` / `min_tokens`; events after that are the
continuation, with `num_prompt_tokens` restored to the client's prompt. The client sees
one continuous stream. Attempts back off exponentially, up to `failover_timeout_s`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence

from gateway.scheduler_link import LinkBroken, SchedulerLink
from stepahead.v1 import scheduler_pb2

AFFINITY_TOKENS = 32  # the prompt prefix that decides affinity


class SchedulerPool:
    def __init__(self, links: Sequence[SchedulerLink], names: Sequence[str], log,
                 failover_timeout_s: float = 60.0, balance_abs_threshold: int = 8) -> None:
        assert links and len(links) == len(names)
        self._links, self._names, self._log = list(links), list(names), log
        self._down_until = [0.0] * len(links)  # monotonic: skip a link that just broke
        self._failover_timeout_s = failover_timeout_s
        self._balance = balance_abs_threshold
        self._where: dict[str, int] = {}  # request id -> the link it is on
        self._lock = threading.Lock()

    def submit(self, msg: scheduler_pb2.SubmitRequest) -> Iterator[scheduler_pb2.TokenEvent]:
        """Like `SchedulerLink.submit`, surviving the loss of the scheduler serving it."""
        index = self._choose(msg, exclude=None)
        events = self._submit_on(index, msg)  # a duplicate id raises ValueError here
        return self._follow(msg, index, events)

    def abort(self, request_id: str) -> None:
        with self._lock:
            index = self._where.get(request_id)
        if index is not None:
            self._links[index].abort(request_id)

    def _submit_on(self, index: int, msg: scheduler_pb2.SubmitRequest):
        with self._lock:
            self._where[msg.request_id] = index
        return self._links[index].submit(msg)

    def _follow(self, msg, index: int, events) -> Iterator[scheduler_pb2.TokenEvent]:
        streamed: list[int] = []
        offset = 0  # tokens streamed when the current submission was made (in its prompt)
        deadline, backoff = None, 0.05
        try:
            while True:
                try:
                    for event in events:
                        if offset and event.num_prompt_tokens >= offset:
                            event.num_prompt_tokens -= offset
                        streamed += event.token_ids
                        yield event
                    return
                except LinkBroken as exc:
                    self._mark_down(index, backoff)
                    deadline = deadline or time.monotonic() + self._failover_timeout_s
                    if time.monotonic() >= deadline:
                        raise LinkBroken(f"{exc} (no scheduler took the request over for "
                                         f"{self._failover_timeout_s:g} s)") from None
                    time.sleep(backoff if self._all_down() else 0)
                    backoff = min(backoff * 2, 2.0)
                    index = self._choose(msg, exclude=index)
                    self._log.warning("request_resubmitted", request_id=msg.request_id, reason=str(exc),
                                      scheduler=self._names[index], tokens_streamed=len(streamed))
                    offset = len(streamed)
                    events = self._submit_on(index, continuation(msg, streamed))
        finally:
            with self._lock:
                self._where.pop(msg.request_id, None)

    def _choose(self, msg: scheduler_pb2.SubmitRequest, exclude: int | None) -> int:
        now = time.monotonic()
        candidates = [i for i in range(len(self._links)) if i != exclude and self._down_until[i] <= now]
        if not candidates:  # every other one is down (or there is only one): try them all
            candidates = [i for i in range(len(self._links)) if i != exclude] or [exclude]
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
    return out
