"""Tensor-parallel groups on the scheduler side (pure domain: no grpc, no torch).

A group of k workers is one replica. It forms in two phases:

1. `GroupFormer` (the JoinGroup call): workers asking with the same k are grouped in the
   order they asked; when the k-th arrives, each learns its rank and rank 0's rendezvous
   address. A caller that goes away before its group is complete is removed.
2. `GroupAssembly` (the engine's loop): after their rendezvous and loading, the ranks open
   AttachWorker with the group in their hello. When all k have attached, the assembly
   hands the engine one `GroupHandle`, which the engine treats like a single worker:
   each plan goes to every rank (`FanOutbox`), results come from rank 0 only, and the
   loss of any rank is the loss of the group (the engine closes every rank's stream).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.links import PlanOutbox, WorkerHandle, WorkerRefused
from stepahead.plan import StepPlan


@dataclass(frozen=True)
class Assignment:
    group_id: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int


@dataclass(eq=False)
class Joiner:
    worker_id: str
    size: int
    host: str
    port: int
    assignment: Assignment | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    notify: Callable[[], None] = lambda: None  # called once done is set (on the thread that set it)


class GroupFormer:
    """Groups JoinGroup callers by size, in call order. Thread-safe (one thread per call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, list[Joiner]] = {}
        self._ids = itertools.count(1)
        self._life = secrets.token_hex(3)  # a group id never names a group of an earlier scheduler life
        self.formed: dict[str, int] = {}  # group id -> size: what a hello may claim

    def join(self, joiner: Joiner) -> Assignment | None:
        """Blocks until the joiner's group is complete (its assignment) or it is cancelled (None)."""
        self.enqueue(joiner)
        joiner.done.wait()
        return joiner.assignment

    def enqueue(self, joiner: Joiner) -> None:
        """`join` without the wait: `joiner.done` is set (and `joiner.notify` called) once its
        group is complete or it is cancelled (the daemon's event loop awaits that)."""
        with self._lock:
            queue = self._waiting.setdefault(joiner.size, [])
            queue.append(joiner)
            if len(queue) == joiner.size:
                self._form(self._waiting.pop(joiner.size))

    def cancel(self, joiner: Joiner) -> None:
        """The caller went away: out of the queue if its group has not formed yet."""
        with self._lock:
            queue = self._waiting.get(joiner.size, [])
            if joiner in queue:
                queue.remove(joiner)
        if not joiner.done.is_set():
            joiner.done.set()
            joiner.notify()

    def _form(self, members: list[Joiner]) -> None:
        group_id, master = f"tp{next(self._ids)}-{self._life}", members[0]
        self.formed[group_id] = len(members)
        for rank, m in enumerate(members):
            m.assignment = Assignment(group_id, rank, len(members), master.host, master.port)
            m.done.set()
            m.notify()


class FanOutbox:
    """One plan to every rank's outbox (a `PlanOutbox` or a `LoopOutbox`); returns once each
    wrote it (or its handoff timeout; at once for the loop's outboxes)."""

    def __init__(self, outboxes: list[PlanOutbox]) -> None:
        self.outboxes = outboxes

    def send(self, plan: StepPlan) -> None:
        for written in [o.post(plan) for o in self.outboxes]:
            written.wait(self.outboxes[0].handoff_timeout_s)

    def accept(self) -> None:
        for o in self.outboxes:
            o.accept()

    def close(self, error: WorkerRefused | None = None) -> None:
        for o in self.outboxes:
            o.close(error)


class GroupHandle(WorkerHandle):
    """A complete group, as the engine sees one worker: rank 0's hello, renamed after the group."""

    def __init__(self, members: list[WorkerHandle]) -> None:
        rank0 = members[0].info
        info = dataclasses.replace(rank0, worker_id=f"{rank0.group_id}[{rank0.worker_id}+{len(members) - 1}]")
        super().__init__(members[0]._deliver, info, FanOutbox([m.outbox for m in members]))
        self.members = members


# hello fields every rank of a group must agree on
_SAME_IN_GROUP = ("model_name", "model_type", "dtype", "block_size", "num_device_blocks", "num_host_blocks",
                  "max_model_len", "vocab_size", "eos_token_ids", "tp_size", "sliding_window")


class GroupAssembly:
    """Ranks that attached, per group, until the group is complete (engine loop only)."""

    def __init__(self, formed: dict[str, int], timeout_s: float) -> None:
        self._formed, self._timeout = formed, timeout_s
        self._forming: dict[str, tuple[float, dict[int, WorkerHandle]]] = {}  # id -> (deadline, rank -> handle)
        self._group_of: dict[WorkerHandle, GroupHandle] = {}  # rank handle -> its complete group

    def add(self, handle: WorkerHandle) -> GroupHandle | None:
        """A rank attached; the group's handle once every rank has (refused ranks are closed)."""
        info = handle.info
        if self._formed.get(info.group_id) != info.tp_size:
            handle.outbox.close(WorkerRefused(WorkerRefused.Kind.INVALID, f"hello: group_id {info.group_id!r} "
                                              f"of size {info.tp_size} was not formed by this scheduler"))
            return None
        _, ranks = self._forming.setdefault(info.group_id, (time.monotonic() + self._timeout, {}))
        if info.tp_rank in ranks:
            handle.outbox.close(WorkerRefused(WorkerRefused.Kind.INVALID,
                                              f"hello: rank {info.tp_rank} of {info.group_id} already attached"))
            return None
        ranks[info.tp_rank] = handle
        if len(ranks) < info.tp_size:
            return None
        del self._forming[info.group_id]
        members = [ranks[r] for r in range(info.tp_size)]
        diff = [k for k in _SAME_IN_GROUP if len({getattr(m.info, k) for m in members}) > 1]
        if diff:
            self._close(members, f"hello: the ranks of {info.group_id} differ in {', '.join(diff)}")
            return None
        group = GroupHandle(members)
        for m in members:
            self._group_of[m] = group
        return group

    def owner(self, handle: WorkerHandle) -> WorkerHandle:
        """The handle the engine keys a replica by: the rank's group, or the worker itself."""
        return self._group_of.get(handle, handle)

    def forget(self, group: WorkerHandle) -> None:
        for m in getattr(group, "members", ()):
            self._group_of.pop(m, None)

    def rank_lost(self, handle: WorkerHandle) -> None:
        """A rank of a group still assembling (or refused) left: the group cannot complete; close the others."""
        self.forget(self._group_of.get(handle))
        entry = self._forming.get(handle.info.group_id)
        if entry is not None and entry[1].get(handle.info.tp_rank) is handle:
            del self._forming[handle.info.group_id]
            self._close(list(entry[1].values()), f"rank {handle.info.tp_rank} of {handle.info.group_id} left "
                                                  "before the group was complete")

    def expire(self, now: float) -> None:
        """Groups not complete within the timeout (a rank died after the rendezvous) are closed."""
        for group_id, (deadline, ranks) in list(self._forming.items()):
            if deadline <= now:
                del self._forming[group_id]
                self._close(list(ranks.values()), f"{group_id}: not every rank attached within {self._timeout:g} s")

    def next_deadline(self) -> float | None:
        return min((d for d, _ in self._forming.values()), default=None)

    @staticmethod
    def _close(members: list[WorkerHandle], reason: str) -> None:
        for m in members:
            m.outbox.close(WorkerRefused(WorkerRefused.Kind.INVALID, reason))
