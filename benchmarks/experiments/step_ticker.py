"""The floor servers' step clock (`grpc_floor.py`, `http_floor.py`): every stream waits on one
shared future that a ticker task completes every `step_s`, the way the gateway's streams all
get a token per scheduler step."""

from __future__ import annotations

import asyncio


class StepTicker:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.tick: asyncio.Future | None = None

    def next_step(self) -> asyncio.Future:
        """The future of the next step (await it shielded: many streams share it)."""
        if self.tick is None:
            self.tick = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._ticker())
        return self.tick

    async def _ticker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.step_s)
            tick, self.tick = self.tick, loop.create_future()
            tick.set_result(None)
