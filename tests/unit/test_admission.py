"""`StreamGate`: the stream limit, and a drain that returns only once every open stream
left (never while one is still open), refusing new streams meanwhile."""

from __future__ import annotations

import threading

import pytest

from gateway.admission import Draining, Overloaded, StreamGate


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
