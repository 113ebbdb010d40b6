"""The gateway merges a request's events that queued up while its stream was busy."""

from __future__ import annotations

import queue

from gateway.scheduler_link import LinkBroken, _coalesce
from stepahead.v1 import common_pb2, scheduler_pb2


def ev(*tokens: int, finish=common_pb2.FINISH_REASON_UNSPECIFIED, cached: int = 0) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", token_ids=tokens, finish_reason=finish, num_prompt_tokens=9,
                                    num_cached_tokens=cached)


def test_queued_events_merge_in_order_up_to_the_final_one():
    q: queue.Queue = queue.Queue()
    for e in (ev(2), ev(3, 4), ev(5, finish=common_pb2.FINISH_REASON_LENGTH, cached=16), ev(99)):
        q.put(e)
    merged, broken = _coalesce(ev(1), q)
    assert list(merged.token_ids) == [1, 2, 3, 4, 5] and broken is None
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH and merged.num_cached_tokens == 16
    assert list(q.get_nowait().token_ids) == [99], "nothing past the final event is taken"


def test_nothing_queued_leaves_the_event_alone():
    event = ev(7)
    merged, broken = _coalesce(event, queue.Queue())
    assert merged is event and broken is None


def test_a_broken_link_is_reported_after_the_tokens_before_it():
    q: queue.Queue = queue.Queue()
    q.put(ev(2))
    q.put(LinkBroken("gone"))
    merged, broken = _coalesce(ev(1), q)
    assert list(merged.token_ids) == [1, 2] and isinstance(broken, LinkBroken)
