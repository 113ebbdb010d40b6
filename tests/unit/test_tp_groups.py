"""Tensor-parallel groups on the scheduler side: JoinGroup callers grouped by size in call
order, ranks assembled into one replica handle, and everything a rank may get wrong."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from scheduler_service.groups import GroupAssembly, GroupFormer, GroupHandle, Joiner
from scheduler_service.links import PlanOutbox, WorkerHandle, WorkerRefused
from stepahead import limits
from stepahead.plan import StepPlan, WorkerInfo

INFO = WorkerInfo("w", "m", "llama", "float32", "cpu", 16, 100, 10, 256, 512, (2,))


def join_all(former: GroupFormer, joiners: list[Joiner]) -> list:
    """Join in list order (each call queued before the next starts), then collect."""
    with ThreadPoolExecutor(len(joiners)) as pool:
        futures = []
        for j in joiners:
            futures.append(pool.submit(former.join, j))
            while j not in former._waiting.get(j.size, []) and not j.done.is_set():
                threading.Event().wait(0.001)  # until the call is queued: fixes the call order
        return [f.result(timeout=10) for f in futures]


def test_callers_of_the_same_size_are_grouped_in_call_order():
    former = GroupFormer()
    joiners = [Joiner(f"w{i}", 2, f"h{i}", 1000 + i) for i in range(4)] + [Joiner("x", 3, "hx", 9)]
    got = join_all(former, joiners[:4])
    life = former._life  # ids are unique across scheduler restarts
    assert [(a.group_id, a.rank) for a in got] == [(f"tp1-{life}", 0), (f"tp1-{life}", 1),
                                                    (f"tp2-{life}", 0), (f"tp2-{life}", 1)]
    assert {(a.master_addr, a.master_port) for a in got[:2]} == {("h0", 1000)}  # rank 0's rendezvous
    assert {(a.master_addr, a.master_port) for a in got[2:]} == {("h2", 1002)}
    assert former.formed == {f"tp1-{life}": 2, f"tp2-{life}": 2}
    assert GroupFormer()._life != life
    lonely = joiners[4]
    threading.Thread(target=former.join, args=(lonely,), daemon=True).start()
    while lonely not in former._waiting.get(3, []):
        threading.Event().wait(0.001)
    former.cancel(lonely)  # its caller went away: no trace left
    assert former._waiting[3] == [] and lonely.assignment is None


def rank(group_id: str, r: int, size: int = 2, **kw) -> WorkerHandle:
    info = dataclasses.replace(INFO, worker_id=f"w{r}", group_id=group_id, tp_rank=r, tp_size=size, **kw)
    return WorkerHandle(lambda item: None, info, PlanOutbox(handoff_timeout_s=0))


def closed(handle: WorkerHandle) -> WorkerRefused | None:
    """The error a handle's outbox was closed with (None: still open or closed cleanly)."""
    return handle.outbox.error


def test_ranks_become_one_handle_whose_plans_reach_every_rank():
    assembly = GroupAssembly({"tp1": 2}, timeout_s=60)
    r1, r0 = rank("tp1", 1), rank("tp1", 0)
    assert assembly.add(r1) is None  # attach order need not be rank order
    group = assembly.add(r0)
    assert isinstance(group, GroupHandle) and group.members == [r0, r1]
    assert group.info.worker_id.startswith("tp1[") and group.info.num_device_blocks == 100
    assert assembly.owner(r0) is group and assembly.owner(r1) is group
    group.outbox.send(StepPlan(0))
    assert [next(iter(m.outbox)).step_id for m in group.members] == [0, 0]
    group.outbox.close()
    assert [list(m.outbox) for m in group.members] == [[], []]
    assembly.forget(group)
    assert assembly.owner(r0) is r0


@pytest.mark.parametrize("case", ["unknown group", "wrong size", "duplicate rank", "geometry differs"])
def test_a_rank_that_does_not_fit_is_refused(case):
    assembly = GroupAssembly({"tp1": 2}, timeout_s=60)
    if case == "unknown group":
        bad = rank("tp9", 0)
        assert assembly.add(bad) is None and "not formed" in str(closed(bad))
    elif case == "wrong size":
        bad = rank("tp1", 0, size=3)
        assert assembly.add(bad) is None and "not formed" in str(closed(bad))
    elif case == "duplicate rank":
        first, bad = rank("tp1", 0), rank("tp1", 0)
        assembly.add(first)
        assert assembly.add(bad) is None and "already attached" in str(closed(bad)) and closed(first) is None
    else:
        r0, r1 = rank("tp1", 0), rank("tp1", 1, num_device_blocks=99)
        assembly.add(r0)
        assert assembly.add(r1) is None
        assert all("num_device_blocks" in str(closed(h)) for h in (r0, r1))


def test_a_group_that_cannot_complete_closes_its_ranks():
    assembly = GroupAssembly({"tp1": 2, "tp2": 2}, timeout_s=5)
    gone, waiting = rank("tp1", 0), rank("tp1", 1)
    assembly.add(gone)
    assembly.add(waiting)  # complete: losing a rank now is the replica's loss (the engine's job)
    late = rank("tp2", 0)
    assembly.add(late)
    deadline = assembly.next_deadline()
    assembly.expire(deadline - 1)
    assert closed(late) is None
    assembly.expire(deadline)
    assert "not every rank attached" in str(closed(late))
    early, other = rank("tp2", 0), rank("tp2", 1)
    assembly2 = GroupAssembly({"tp2": 2}, timeout_s=5)
    assembly2.add(early)
    assembly2.rank_lost(early)
    assert "left before the group was complete" in str(closed(early))
    assert assembly2.add(other) is None  # a fresh, incomplete group again


def test_hello_group_fields_are_checked():
    limits.check_worker_info(dataclasses.replace(INFO, group_id="tp1", tp_rank=1, tp_size=2))
    for bad, field in [(dict(group_id="tp1"), "group_id"), (dict(tp_size=2), "group_id"),
                       (dict(group_id="tp1", tp_rank=2, tp_size=2), "tensor_parallel_rank"),
                       (dict(group_id="tp1", tp_size=0), "tensor_parallel_size")]:
        with pytest.raises(limits.LimitError, match=field):
            limits.check_worker_info(dataclasses.replace(INFO, **bad))
