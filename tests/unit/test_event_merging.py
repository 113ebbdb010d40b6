"""The gateway merges a request's events that queued up while its consumer was busy, holds
tokens to the stream interval, and hands events from a thread to the loop in batches."""

from __future__ import annotations

import asyncio
import threading

from gateway.event_stream import EventMerger, LoopEvents, Mailbox
from gateway.generation import WAKE
from stepahead.v1 import common_pb2, scheduler_pb2


def ev(*tokens: int, rid: str = "r", finish=common_pb2.FINISH_REASON_UNSPECIFIED, cached: int = 0):
    return scheduler_pb2.TokenEvent(request_id=rid, token_ids=tokens, finish_reason=finish, num_prompt_tokens=9,
                                    num_cached_tokens=cached)


def drain(*events, interval: int = 1) -> list:
    """What a consumer takes from a queue holding `events`, message by message."""

    async def run():
        q = Mailbox()
        for e in events:
            q.put_nowait(e)
        m, out = EventMerger(q, interval), []
        while not q.empty() or m._held is not None:
            out.append(await m.next())
        return out

    return asyncio.run(run())


def test_queued_events_merge_in_order_up_to_the_final_one():
    merged, rest = drain(ev(1), ev(2), ev(3, 4), ev(5, finish=common_pb2.FINISH_REASON_LENGTH, cached=16), ev(99))
    assert list(merged.token_ids) == [1, 2, 3, 4, 5]
    assert merged.finish_reason == common_pb2.FINISH_REASON_LENGTH and merged.num_cached_tokens == 16
    assert list(rest.token_ids) == [99], "nothing past the final event is taken"


def test_another_sequence_or_a_wake_up_is_kept_for_later():
    out = drain(ev(1), ev(2), ev(7, rid="r#1"), ev(3), WAKE)
    assert [list(e.token_ids) for e in out[:3]] == [[1, 2], [7], [3]]
    assert out[1].request_id == "r#1" and out[3] is WAKE


def test_nothing_queued_leaves_the_event_alone():
    event = ev(7)
    assert drain(event) == [event]


def test_stream_interval_holds_tokens_but_never_the_first_or_the_end():
    async def run():
        q = Mailbox()
        m = EventMerger(q, stream_interval=3)
        q.put_nowait(ev(1))
        first = await m.next()  # the first token goes out alone, at once
        for t in (2, 3):
            q.put_nowait(ev(t))
        pending = asyncio.ensure_future(m.next())
        await asyncio.sleep(0)  # let it take both queued events
        assert not pending.done(), "2 tokens < the interval of 3 went out"
        q.put_nowait(ev(4))
        held = await pending
        q.put_nowait(ev(5, finish=common_pb2.FINISH_REASON_LENGTH))
        return first, held, await m.next()

    first, held, end = asyncio.run(run())
    assert list(first.token_ids) == [1] and list(held.token_ids) == [2, 3, 4]
    assert list(end.token_ids) == [5] and end.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_loop_events_deliver_every_event_in_order_from_another_thread():
    async def run():
        loop = asyncio.get_running_loop()
        events = LoopEvents(loop)
        queues = [Mailbox() for _ in range(3)]
        sinks = [events.sink(q) for q in queues]

        def reader():
            for i in range(300):
                sinks[i % 3](i)

        thread = threading.Thread(target=reader)
        thread.start()
        got = [[await q.get() for _ in range(100)] for q in queues]
        thread.join()
        return got

    got = asyncio.run(run())
    assert got == [list(range(k, 300, 3)) for k in range(3)]


def test_a_held_sequence_sleeps_until_its_interval_is_queued():
    """With stream interval N the consumer is woken once per N tokens, not once per token;
    another sequence's event wakes it at once (it is kept for after the merged one)."""

    async def settle():
        for _ in range(3):
            await asyncio.sleep(0)

    async def run():
        q = Mailbox()
        m = EventMerger(q, stream_interval=4)
        q.put_nowait(ev(1))
        await m.next()  # the first token goes out at once
        pending = asyncio.ensure_future(m.next())
        for t in (2, 3, 4):
            q.put_nowait(ev(t))
            await settle()
        slept = not q.empty() and not pending.done()  # tokens 3 and 4 still queued: not woken for them
        q.put_nowait(ev(5))
        held = await pending
        second = asyncio.ensure_future(m.next())
        q.put_nowait(ev(6))
        await settle()
        q.put_nowait(ev(70, rid="r#1"))  # another sequence: out now, not after three more tokens
        return slept, held, await second, await m.next()

    slept, held, partial, other = asyncio.run(run())
    assert slept
    assert list(held.token_ids) == [2, 3, 4, 5]
    assert list(partial.token_ids) == [6] and other.request_id == "r#1"


def test_a_consumer_cancelled_while_waiting_leaves_the_mailbox_usable():
    """A client that goes away cancels its task inside `get`; the reader's later events must
    still be accepted (no InvalidStateError from the cancelled future) and stay in order."""

    async def run():
        q = Mailbox()
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        q.put_nowait(1)
        q.put_nowait(2)
        return waiting.cancelled(), [await q.get(), await q.get()], q.empty()

    assert asyncio.run(run()) == (True, [1, 2], True)


def test_plain_tokens_merge_like_token_events_and_keep_their_requests_counts():
    from gateway.plain_tokens import PlainToken

    merged, other = drain(ev(1, cached=4), PlainToken("r", (2,), 9, 4), PlainToken("r", (3,), 9, 4),
                          PlainToken("r#1", (7,), 5, 0))
    assert list(merged.token_ids) == [1, 2, 3] and (merged.num_prompt_tokens, merged.num_cached_tokens) == (9, 4)
    assert isinstance(other, PlainToken) and other.token_ids == (7,)
    held = drain(PlainToken("r", (2,), 9, 4), PlainToken("r", (3,), 9, 4), ev(4, finish=common_pb2.FINISH_REASON_LENGTH),
                 interval=4)
    assert [list(e.token_ids) for e in held] == [[2, 3, 4]], "queued plain tokens merge up to the final event"
