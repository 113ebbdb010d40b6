"""The plan outbox between the engine and the thread writing a worker's stream: plans leave in
order, the engine's hand-off is released once the writer came back for the next message (or
after its timeout), and a closed outbox ends the writer."""

from __future__ import annotations

import threading

from scheduler_service.links import Handoff, PlanOutbox
from stepahead.plan import StepPlan


def test_a_handoff_times_out_unset_and_stays_set_once_set():
    handoff = Handoff()
    assert handoff.wait(0.001) is False
    handoff.set()
    assert handoff.wait(0) is True
    assert handoff.wait(0) is True  # waiting does not consume it


def test_a_plan_is_handed_off_when_the_writer_comes_back_for_the_next_message():
    accepted = threading.Event()
    outbox = PlanOutbox(on_accept=accepted.set)
    writer = iter(outbox)
    outbox.accept()
    first, second = outbox.post(StepPlan(step_id=0)), outbox.post(StepPlan(step_id=1))
    assert next(writer).step_id == 0 and accepted.is_set()
    assert not first.wait(0)  # taken, but the stream has not asked for the next message yet
    assert next(writer).step_id == 1
    assert first.wait(0) and not second.wait(0)
    outbox.close()
    assert list(writer) == [] and second.wait(0)  # the writer came back: the last plan is out too


def test_send_returns_after_the_handoff_timeout_when_no_writer_reads():
    outbox = PlanOutbox(handoff_timeout_s=0.01)
    outbox.send(StepPlan(step_id=0))  # returns: a stalled stream never blocks the engine for long
    outbox.close()
    assert [p.step_id for p in outbox] == [0]


def test_a_loop_outbox_yields_the_acceptance_then_plans_in_order_and_ends_at_close():
    import asyncio

    from scheduler_service.links import LoopOutbox, WorkerRefused

    async def main():
        outbox, got = LoopOutbox(), []

        async def writer():
            async for item in outbox:
                got.append(item if item is LoopOutbox.ACCEPTED else item.step_id)

        task = asyncio.ensure_future(writer())
        await asyncio.sleep(0)  # the writer waits
        outbox.accept()
        outbox.send(StepPlan(step_id=0))
        assert outbox.post(StepPlan(step_id=1)).wait(0)  # nothing to wait for on the loop
        await asyncio.sleep(0)
        outbox.close(WorkerRefused(WorkerRefused.Kind.INVALID, "bad"))
        await asyncio.wait_for(task, 5)
        assert got == [LoopOutbox.ACCEPTED, 0, 1] and str(outbox.error) == "bad"

    asyncio.run(main())
