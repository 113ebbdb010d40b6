"""Only a worker that says it leaves is a clean detach: an attach stream that just ends (a
SIGKILLed worker's can end without an error on the scheduler's side) is a lost worker, so its
loss is logged as one and counted in stepahead:workers_lost_total."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_service.server import SchedulerServicer
from stepahead.v1 import scheduler_pb2


class Handle:
    """The part of a WorkerHandle the result reader uses."""

    class info:  # noqa: N801
        tp_rank = 0

    def __init__(self) -> None:
        self.results, self.lost = [], []

    def on_result(self, result) -> None:
        self.results.append(result)

    def on_lost(self, reason, error=None, clean=False) -> None:
        self.lost.append((reason, error, clean))


@pytest.mark.parametrize("messages, clean, reason", [
    ([], False, "ended without a detach"),
    ([scheduler_pb2.WorkerMessage(detach="the worker is stopping")], True, "the worker detached"),
    ([scheduler_pb2.WorkerMessage(fatal_error="boom")], False, "the worker failed: boom"),
])
def test_only_a_detach_message_makes_the_end_clean(messages, clean, reason):
    handle = Handle()

    async def stream():
        for msg in messages:
            yield msg

    asyncio.run(SchedulerServicer(engine=None, log=None)._read_results(stream(), handle))
    [(got_reason, error, got_clean)] = handle.lost
    assert got_clean is clean and reason in got_reason and error is None
