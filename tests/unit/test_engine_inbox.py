"""The engine plans between its inbox's items, not after the inbox runs dry; a gateway
session's submissions wait in its inbox only up to a bound.

The engine handles what queued up before it plans, so one plan takes in every request that
arrived meanwhile. What arrives *while* it handles that backlog waits for the next round: a
steady flood of submissions (a gateway forwarding a long burst, or a client on the internal
port hammering it with bad ones) must not keep a device that has room from its next plan.
Before this rule the engine planned only once its inbox was empty. And a peer that submits
faster than the engine takes them is held back at the stream (its reader blocks), instead of
piling requests up in the engine's memory.
"""

from __future__ import annotations

import queue
import threading

import structlog

from scheduler_service.engine import Engine, PlanOutbox
from scheduler_service.links import GatewaySession
from scheduler_service.core.request import Request
from scheduler_service.server import SchedulerDaemonConfig
from stepahead.plan import SamplingParams, WorkerInfo

FLOOD_CAP = 3000  # the flood stops by itself after this many submissions


class Flood(GatewaySession):
    """A session whose every rejection is answered, on the engine thread, by one more
    submission that will be rejected too: the inbox is never empty until the cap or a plan."""

    def __init__(self, engine: Engine, duplicate_of: str, plans: queue.SimpleQueue) -> None:
        super().__init__()
        self.engine, self.duplicate_of, self.plans = engine, duplicate_of, plans
        self.submitted = 0
        self.at_first_plan: int | None = None

    def submit_one(self) -> None:
        self.submitted += 1
        self.engine.submit(Request(self.duplicate_of, [1, 2, 3], SamplingParams(max_tokens=4)), self)

    def put_many(self, events: list) -> None:
        super().put_many(events)
        if self.at_first_plan is None and not self.plans.empty():
            self.at_first_plan = self.submitted
        if self.at_first_plan is None and self.submitted < FLOOD_CAP:
            self.submit_one()


class Gate(GatewaySession):
    """Holds the engine thread inside its first rejection until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def put_many(self, events: list) -> None:
        super().put_many(events)
        self.entered.set()
        assert self.release.wait(30)


def started_engine() -> tuple[Engine, queue.SimpleQueue]:
    """An engine with one replica attached; the plans its worker gets."""
    engine = Engine(SchedulerDaemonConfig().core_config, structlog.get_logger())
    engine.start()
    accepted, plans = queue.SimpleQueue(), queue.SimpleQueue()
    outbox = PlanOutbox(on_accept=lambda: accepted.put(True))
    engine.attach_worker(WorkerInfo("w0", "m", "llama", "bfloat16", "sim", 16, 2000, 0, 4096, 1000, (0,)), outbox)
    threading.Thread(target=lambda: [plans.put(plan) for plan in outbox], daemon=True).start()
    assert accepted.get(timeout=30)
    engine.stats()  # a round trip through the engine thread: the replica is in place
    return engine, plans


def test_a_flood_of_submissions_does_not_hold_back_the_next_plan():
    engine, plans = started_engine()

    gate = Gate()
    engine.submit(Request("gate", [5000], SamplingParams(max_tokens=4)), gate)  # refused: id 5000 ≥ vocab
    assert gate.entered.wait(30)  # the engine thread is held; what follows queues up behind it
    engine.submit(Request("r0", [5, 6, 7, 8], SamplingParams(max_tokens=4)), GatewaySession())
    flood = Flood(engine, "r0", plans)
    flood.submit_one()
    gate.release.set()

    first = plans.get(timeout=60)
    assert [s.request_id for s in first.new_requests] == ["r0"]
    engine.stats()  # the flood has ended: the engine answers calls again
    engine.stop()
    # the plan left once the backlog of two items was handled, not after the flood ran dry (a
    # few more may pass while the writer thread takes the plan from the outbox)
    assert flood.at_first_plan is not None and flood.at_first_plan <= 100, (flood.at_first_plan, FLOOD_CAP)


def test_a_session_queues_at_most_its_bound_of_submissions():
    engine, _ = started_engine()
    gate = Gate()
    engine.submit(Request("gate", [5000], SamplingParams(max_tokens=4)), gate)
    assert gate.entered.wait(30)  # nothing is handled from here until the release
    session, submitted, at_bound = GatewaySession(max_unhandled=4), [], threading.Event()

    def reader():  # the session's stream reader: ten submissions in a row
        for i in range(10):
            engine.submit(Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2)), session)
            submitted.append(i)
            if len(submitted) == 4:
                at_bound.set()

    thread = threading.Thread(target=reader)
    thread.start()
    assert at_bound.wait(30)
    thread.join(0.5)  # room for a fifth to return if nothing held it (never needed to pass)
    assert thread.is_alive() and len(submitted) == 4, submitted
    gate.release.set()
    thread.join(30)
    assert len(submitted) == 10
    stats, _ = engine.stats()  # queued behind all ten: every one was handled, none refused
    engine.stop()
    assert stats.num_running + stats.num_waiting == 10
