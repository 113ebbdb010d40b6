"""A gateway session's bound on submissions waiting in the engine's inbox, for a reader on the
engine's event loop (the daemon's Connect reader): it awaits room instead of blocking a
thread, and a reader that went away while waiting never swallows the room another one needs."""

from __future__ import annotations

import asyncio

from scheduler_service.links import GatewaySession


def test_a_loop_reader_awaits_room_at_the_bound_and_goes_on_once_one_is_handled():
    async def main():
        session, taken = GatewaySession(max_unhandled=2), []

        async def reader():
            for i in range(3):
                await session.reserve_async()
                taken.append(i)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.01)
        assert taken == [0, 1] and not task.done()  # at the bound: the third waits
        session.handled()
        await asyncio.wait_for(task, 5)
        assert taken == [0, 1, 2]

    asyncio.run(main())


def test_a_reader_cancelled_while_waiting_does_not_take_the_next_ones_room():
    async def main():
        session, order = GatewaySession(max_unhandled=1), []
        await session.reserve_async()

        async def reader(name):
            await session.reserve_async()
            order.append(name)

        first, second = asyncio.ensure_future(reader("first")), asyncio.ensure_future(reader("second"))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        session.handled()
        await asyncio.wait_for(second, 5)
        assert order == ["second"]

    asyncio.run(main())


def test_the_loop_writer_gets_batches_merged_and_ends_at_close():
    async def main():
        session, got = GatewaySession(), []

        async def writer():
            async for batch in session.batches():
                got.append(batch)

        task = asyncio.ensure_future(writer())
        await asyncio.sleep(0)
        session.put_many(["a"])
        session.put_many(["b"])  # queued before the writer ran: one merged batch
        await asyncio.sleep(0.01)
        session.put_many(["c"])
        session.close()
        await asyncio.wait_for(task, 5)
        assert got == [["a", "b"], ["c"]]

    asyncio.run(main())
