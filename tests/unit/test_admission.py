"""`StreamGate`: the stream limit, and a drain that returns only once every open stream
left (never while one is still open), refusing new streams meanwhile."""

from __future__ import annotations

import threading

import pytest

from gateway.admission import Draining, Overloaded, StreamGate
from stepahead import codec


def test_the_limit_refuses_at_once_and_a_left_slot_is_free_again():
    gate = StreamGate(2)
    gate.enter()
    gate.enter()
    with pytest.raises(Overloaded):
        gate.enter()
    gate.leave()
    gate.enter()
    assert gate.active == 2


def test_drain_with_one_stream_open_times_out_false():
    gate = StreamGate(4)
    gate.enter()
    gate.enter()
    gate.leave()
    assert gate.drain(0.05) is False  # one is still open
    assert gate.active == 1


def test_drain_waits_for_the_last_open_stream_and_refuses_new_ones():
    gate = StreamGate(4)
    for _ in range(3):
        gate.enter()
    result: list[bool] = []
    waiting = threading.Thread(target=lambda: result.append(gate.drain(60.0)))
    waiting.start()
    gate.leave()
    gate.leave()
    waiting.join(0.3)  # room to fail: a drain that returns with one stream open is done by now
    assert waiting.is_alive() and not result, "drain() returned while a stream was still open"
    with pytest.raises(Draining):
        gate.enter()
    assert gate.active == 1
    gate.leave()
    waiting.join(10)
    assert result == [True]


def test_drain_with_nothing_open_returns_true_at_once():
    assert StreamGate(1).drain(0.0) is True


# ---- a request's slot: held until its transport sent the last message ---------------------

def _frontend(gate: StreamGate):
    from gateway.generation import Frontend
    from gateway.metrics import GatewayMetrics
    from stepahead.v1 import scheduler_pb2
    from tests.unit.test_gateway_frontend import CharTokenizer, FakeLink

    hello = scheduler_pb2.WorkerHello(model_name="m", max_model_len=64, vocab_size=100)
    return Frontend(CharTokenizer(), codec.worker_info_from_proto(hello), FakeLink(), 1 << 20, GatewayMetrics(), gate)


def _start(front, rid="r"):
    from gateway.openai_protocol import CompletionRequest, completion_to_raw

    return front.start(front.validate(completion_to_raw(CompletionRequest(prompt="hi"), 10)), rid, lambda _: None,
                       "grpc")


def _token(rid, ids, final=False):
    from stepahead.v1 import common_pb2, scheduler_pb2

    return scheduler_pb2.TokenEvent(request_id=rid, token_ids=ids, finish_reason=common_pb2.FINISH_REASON_LENGTH
                                    if final else common_pb2.FINISH_REASON_UNSPECIFIED)


def test_a_drain_waits_until_the_transport_sent_the_final_message():
    """Processing the final event is not sending it: the slot (and so the drain) waits for the
    transport's end of the call, else the server stops under a message still being written."""
    gate = StreamGate(4)
    front = _frontend(gate)
    gen = _start(front)
    gen.on_event(_token("r", [1, 2]))
    gen.on_event(_token("r", [3], final=True))
    assert gen.done and gate.active == 1
    assert gate.drain(0.0) is False
    gen.abort()  # the transport's finally, after its last message
    assert gate.active == 0 and gate.drain(0.0) is True
    gen.abort()
    assert gate.active == 0  # given back once


def _mismatches(front, transport="grpc") -> float:
    return front.metrics.registry.get_sample_value("stepahead:gateway_usage_mismatch_total", {"transport": transport})


def test_usage_equal_to_the_delivered_ids_passes_and_a_difference_is_counted():
    front = _frontend(StreamGate(4))
    assert _mismatches(front) == 0.0 and _mismatches(front, "http") == 0.0
    whole = _start(front, "a")
    for event in (_token("a", [1, 2]), _token("a", [3], final=True)):
        whole.delivered(whole.on_event(event))
    assert _mismatches(front) == 0.0
    short = _start(front, "b")
    short.on_event(_token("b", [1, 2]))  # processed, never handed to the client
    short.delivered(short.on_event(_token("b", [3], final=True)))
    assert _mismatches(front) == 1.0


# ---- request ids: scoped per client -------------------------------------------------------

class _DedupLink:
    """A link that refuses an upstream id already in flight (as `SchedulerLink` does)."""

    def __init__(self):
        self.open: set[str] = set()

    def submit(self, msg, sink):
        if msg.request_id in self.open:
            raise ValueError(f"request_id {msg.request_id!r} is already in flight on this gateway")
        self.open.add(msg.request_id)

    def abort(self, rid):
        pass

    def release(self, rid):
        self.open.discard(rid)


def _start_as(front, client, rid, n=1):
    from gateway.openai_protocol import CompletionRequest, completion_to_raw

    valid = front.validate(completion_to_raw(CompletionRequest(prompt="hi", n=n), 10))
    return front.start(valid, rid, lambda _: None, "grpc", client)


def test_a_client_cannot_block_another_clients_request_id():
    front = _frontend(StreamGate(8))
    front.link = _DedupLink()
    mine = _start_as(front, "key:Bearer alice", "fixed-id")
    theirs = _start_as(front, "key:Bearer mallory", "fixed-id")  # the same id, another client: its own
    assert mine.upstream_ids != theirs.upstream_ids
    with pytest.raises(ValueError):
        _start_as(front, "key:Bearer alice", "fixed-id")  # a client's own id stays unique for it
    mine.abort()
    again = _start_as(front, "key:Bearer alice", "fixed-id")  # free again once it ended
    assert again.upstream_ids == mine.upstream_ids


def test_scoped_ids_keep_within_the_id_limit_and_never_name_the_key():
    from gateway.generation import scoped_id
    from stepahead.limits import MAX_ID_CHARS

    long_id = "x" * MAX_ID_CHARS
    scoped = scoped_id("key:Bearer sk-secret", long_id)
    assert len(scoped + "#999") <= MAX_ID_CHARS and "secret" not in scoped
    assert scoped != scoped_id("key:Bearer sk-other", long_id)
    assert scoped_id("peer:ipv4:127.0.0.1:1", "a") != scoped_id("peer:ipv4:127.0.0.1:2", "a")
    front = _frontend(StreamGate(8))
    front.link = _DedupLink()
    gen = _start_as(front, "peer:ipv4:127.0.0.1:1", long_id, n=3)
    assert all(len(rid) <= MAX_ID_CHARS for rid in gen.upstream_ids) and len(set(gen.upstream_ids)) == 3


def test_each_refusal_for_the_limit_is_reported_and_a_drain_refusal_is_not():
    refused = []
    gate = StreamGate(1, on_overloaded=refused.append)
    gate.enter()
    for _ in range(3):
        with pytest.raises(Overloaded):
            gate.enter()
    assert refused == [1, 1, 1] and gate.active == 1
    gate.leave()
    gate.drain(0.0)
    with pytest.raises(Draining):
        gate.enter()
    assert refused == [1, 1, 1]
