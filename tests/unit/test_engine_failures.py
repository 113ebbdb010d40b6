"""The engine never dies of a request.

- A request that waited while no replica was attached (parked) used to reach a core's waiting
  heap through `adopt` with no arrival time, so the next submission's heap push compared
  `None` with a float and the engine thread died (`engine_crashed`, the scheduler process
  exited, its gateway resubmitted every open stream).
- Whatever a bug raises while one request's inbox item is handled fails that request alone:
  its stream gets one UNAVAILABLE answer, the engine goes on.
- A refused submission gives its session's inbox slot back, or 4096 refusals would wedge a
  gateway's stream.
"""

from __future__ import annotations

import queue
import threading

import structlog

from scheduler_service.engine import Engine, PlanOutbox
from scheduler_service.links import GatewaySession, RejectCode, Rejected
from scheduler_service.core.request import Request
from scheduler_service.server import SchedulerDaemonConfig
from stepahead.plan import SamplingParams, WorkerInfo

from tests.unit.test_engine_inbox import Gate, started_engine

WAIT_S = 30  # room to fail only: every wait below returns as soon as its event happens


def attach(engine: Engine, worker_id: str) -> tuple[object, queue.SimpleQueue]:
    """Attach a worker; (its handle, the queue of the plans it gets)."""
    accepted, plans = queue.SimpleQueue(), queue.SimpleQueue()
    outbox = PlanOutbox(on_accept=lambda: accepted.put(True))
    info = WorkerInfo(worker_id, "m", "llama", "bfloat16", "sim", 16, 2000, 0, 4096, 1000, (0,))
    handle = engine.attach_worker(info, outbox)
    threading.Thread(target=lambda: [plans.put(plan) for plan in outbox], daemon=True).start()
    assert accepted.get(timeout=WAIT_S)
    return handle, plans


def planned_ids(plans: queue.SimpleQueue, want: set[str]) -> set[str]:
    """Request ids of the new requests in the plans that come, until every one of `want` came."""
    seen: set[str] = set()
    while not want <= seen:
        seen.update(r.request_id for r in plans.get(timeout=WAIT_S).new_requests)
    return seen


def alive(engine: Engine) -> bool:
    try:
        engine._call(lambda: True, WAIT_S)
    except queue.Empty:
        return False
    return not engine.crashed


def rejections(session: GatewaySession, n: int) -> list[Rejected]:
    """The first `n` rejections the engine hands `session` (queue.Empty if they do not come)."""
    got: list[Rejected] = []
    while len(got) < n:
        got += [e for e in session._batches.get(timeout=WAIT_S) if isinstance(e, Rejected)]
    return got


def test_a_request_parked_without_replicas_queues_beside_later_ones():
    engine = Engine(SchedulerDaemonConfig().core_config, structlog.get_logger())
    engine.start()
    first, _ = attach(engine, "w0")
    first.on_lost("the worker went away")
    session = GatewaySession()
    engine.submit(Request("parked", [5, 6, 7], SamplingParams(max_tokens=2)), session)  # no replica: it waits
    _, plans = attach(engine, "w1")  # adopts the parked request
    assert "parked" in planned_ids(plans, {"parked"})
    engine.submit(Request("later", [8, 9, 10], SamplingParams(max_tokens=2)), session)
    assert alive(engine)
    stats, _ = engine.stats()  # both held by the new replica's core (the second one waits for room)
    assert stats.num_running + stats.num_waiting == 2
    engine.stop()


def test_a_bug_while_handling_one_submission_fails_that_request_alone():
    engine, plans = started_engine()
    core = engine._call(lambda: next(iter(engine._replicas.values())).scheduler)
    real_add = core.add_request

    def add_request(request):
        if request.request_id == "doomed":
            raise RuntimeError("a bug in the core")
        real_add(request)

    core.add_request = add_request  # the engine thread reads it at the next submission
    doomed, other = GatewaySession(), GatewaySession()
    engine.submit(Request("doomed", [5, 6, 7], SamplingParams(max_tokens=2)), doomed)
    engine.submit(Request("other", [5, 6, 8], SamplingParams(max_tokens=2)), other)
    [answer] = rejections(doomed, 1)
    assert answer.request_id == "doomed" and answer.code is RejectCode.UNAVAILABLE
    assert "internal error" in answer.message
    assert "other" in planned_ids(plans, {"other"})
    assert alive(engine)
    assert engine._call(lambda: "doomed" not in engine._streams and "doomed" not in engine._owner)
    engine.stop()


def test_refused_submissions_give_their_inbox_slot_back():
    engine, _ = started_engine()
    session, done = GatewaySession(max_unhandled=4), threading.Event()

    def reader():  # ten refused submissions in a row (token id 5000 is past the vocabulary)
        for i in range(10):
            engine.submit(Request(f"bad{i}", [5000], SamplingParams(max_tokens=2)), session)
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    got = rejections(session, 10)
    assert done.wait(WAIT_S), "a refusal kept its inbox slot: the session's reader is wedged"
    assert sorted(r.request_id for r in got) == sorted(f"bad{i}" for i in range(10))
    assert all(r.code is RejectCode.INVALID for r in got)
    engine.stop()


def test_a_request_its_core_sheds_after_queueing_is_answered_queue_full():
    """Admission control refuses a queued request not admitted within --max-wait-time
    (`Scheduler.take_shed`): its stream gets one QUEUE_FULL answer (the gateway's 429 /
    RESOURCE_EXHAUSTED with Retry-After) and the engine lets go of it; other streams go on."""
    from scheduler_service.core.request import QueueFull

    engine, plans = started_engine()
    core = engine._call(lambda: next(iter(engine._replicas.values())).scheduler)
    real_take_shed, pending = core.take_shed, []

    def take_shed():  # reports "shed" once it is queued (the core itself keeps it: nothing reads it later)
        shed = real_take_shed()
        if pending and pending[0] in core._requests:
            shed.append((pending.pop(), QueueFull("not admitted within --max-wait-time 30 s; retry later")))
        return shed

    core.take_shed = take_shed
    waiting, other = GatewaySession(), GatewaySession()
    pending.append("shed")
    # both queued before the first schedule: this worker never answers a plan, so once the
    # window is full of steps for "shed" alone a later "other" could never be planned
    gate = Gate()
    engine.submit(Request("gate", [5000], SamplingParams(max_tokens=2)), gate)  # refused: id 5000 >= vocab
    assert gate.entered.wait(WAIT_S)  # the engine thread is held; both submissions queue behind it
    engine.submit(Request("shed", [5, 6, 7], SamplingParams(max_tokens=2)), waiting)
    engine.submit(Request("other", [5, 6, 8], SamplingParams(max_tokens=2)), other)
    gate.release.set()
    [answer] = rejections(waiting, 1)
    assert answer.request_id == "shed" and answer.code is RejectCode.QUEUE_FULL
    assert "max-wait-time" in answer.message
    assert "other" in planned_ids(plans, {"other"})
    assert engine._call(lambda: "shed" not in engine._streams and "shed" not in engine._owner)
    assert alive(engine)
    engine.stop()
