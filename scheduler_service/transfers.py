"""The engine's record of requests moving from prefill to decode replicas (disaggregation).

Pure bookkeeping, on the engine's thread. A move starts when a prefill replica's core hands
a request off (`Scheduler.take_handoffs`) and the engine gives it to a decode replica
(`Scheduler.add_transferred`) under a fresh transfer id; it ends when the decode core no
longer needs the source blocks (`Scheduler.take_released_sources`: the KV is loaded, the
load failed, the request ended or moved first), and the engine then frees them on the
prefill core (`Scheduler.release_handoff`). A prefill replica that is lost takes its moves
with it: their decode cores hear `source_lost`.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable


class Transfers:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._moving: dict[int, tuple[Hashable, str]] = {}  # transfer id -> (source replica, request id)

    def start(self, source: Hashable, request_id: str) -> int:
        """A new move of `request_id` from replica `source`; its transfer id."""
        transfer_id = next(self._ids)
        self._moving[transfer_id] = (source, request_id)
        return transfer_id

    def end(self, transfer_ids: Iterable[int]) -> list[tuple[Hashable, str]]:
        """(source replica, request id) of each ended move still on record."""
        return [moved for tid in transfer_ids if (moved := self._moving.pop(tid, None)) is not None]

    def from_source(self, source: Hashable) -> list[tuple[int, str]]:
        """(transfer id, request id) of the moves out of `source`, forgotten."""
        ended = [(tid, rid) for tid, (src, rid) in self._moving.items() if src == source]
        for tid, _ in ended:
            del self._moving[tid]
        return ended

    def __len__(self) -> int:
        return len(self._moving)
