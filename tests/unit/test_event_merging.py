"""The gateway merges a request's events that queued up while its consumer was busy."""

from __future__ import annotations

import queue

from gateway.generation import WAKE, EventMerger
from stepahead.v1 import common_pb2, scheduler_pb2


def ev(*tokens: int, rid: str = "r", finish=common_pb2.FINISH_REASON_UNSPECIFIED, cached: int = 0):
    return scheduler_pb2.TokenEvent(request_id=rid, token_ids=tokens, finish_reason=finish, num_prompt_tokens=9,
                                    num_cached_tokens=cached)


def merger(*events) -> EventMerger:
    q: queue.SimpleQueue = queue.SimpleQueue()
    for e in events:
        q.put(e)
    return EventMerger(q)


def test_queued_events_merge_in_order_up_to_the_final_one():
    m = merger(ev(1), ev(2), ev(3, 4), ev(5, finish=common_pb2.FINISH_REASON_LENGTH, cached=16), ev(99))
    merged = m.next()
    assert list(merged.token_ids) == [1, 2, 3, 4, 5]
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH and merged.num_cached_tokens == 16
    assert list(m.next().token_ids) == [99], "nothing past the final event is taken"


def test_another_sequence_or_a_wake_up_is_kept_for_later():
    m = merger(ev(1), ev(2), ev(7, rid="r#1"), ev(3), WAKE)
    assert list(m.next().token_ids) == [1, 2]
    assert m.next().request_id == "r#1"
    assert list(m.next().token_ids) == [3]
    assert m.next() is WAKE


def test_nothing_queued_leaves_the_event_alone():
    event = ev(7)
    assert merger(event).next() is event
