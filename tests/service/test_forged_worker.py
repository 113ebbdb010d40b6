"""The scheduler never trusts a worker message: a forged or broken `StepResult` closes that
worker's stream with INVALID_ARGUMENT naming the problem and drops that replica only; its
requests move to the other replica as recompute (their committed tokens kept, none twice),
the other replica's requests are unaffected, and the scheduler keeps serving.

The test itself plays the worker on a real scheduler daemon (AttachWorker with a hello),
and a gateway through a raw Connect stream.
"""

from __future__ import annotations

import math
import os
import queue
import subprocess
import sys
import threading
import time

import grpc
import pytest

from stepahead import columns
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.service.streams import ConnectSession

VOCAB = 4096
HELLO = scheduler_pb2.WorkerHello(
    worker_id="test-worker", model_name="tiny", model_type="llama", dtype="float32", device="cpu",
    block_size=16, num_device_blocks=64, num_host_blocks=0, max_model_len=2048, vocab_size=VOCAB,
    eos_token_ids=[2],
)


@pytest.fixture(scope="module")
def scheduler():
    port = free_port()
    env = dict(os.environ, STEPAHEAD_LOG_LEVEL="warning")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "scheduler", "--port", str(port)], env=env)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        yield proc, address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class FakeWorker:
    """An attach stream driven by the test: receive plans, answer whatever it likes. With
    `auto_token`, a thread answers every plan honestly with that token."""

    def __init__(self, channel, hello=HELLO, worker_id: str = "", auto_token: int | None = None) -> None:
        if worker_id:
            hello = scheduler_pb2.WorkerHello()
            hello.CopyFrom(HELLO)
            hello.worker_id = worker_id
        self.outbox: queue.Queue = queue.Queue()
        self.outbox.put(scheduler_pb2.WorkerMessage(hello=hello))
        self.plans = scheduler_pb2_grpc.SchedulerStub(channel).AttachWorker(iter(self.outbox.get, None))
        self.seen: list[str] = []  # request ids of every NewRequest received
        if auto_token is not None:
            threading.Thread(target=self._answer_all, args=(auto_token,), daemon=True).start()

    def next_plan(self) -> scheduler_pb2.StepPlan:
        plan = next(self.plans).plan
        self.seen += [r.request_id for r in plan.new_requests]
        return plan

    def _answer_all(self, token: int) -> None:
        try:
            while True:
                self.answer(self.next_plan(), token)
        except grpc.RpcError:  # closed by the test
            pass

    def send(self, sampled: dict[str, int] | None = None, **result) -> None:
        """`sampled` (request id -> token) goes out as the two parallel columns."""
        if sampled is not None:
            result.update(sampled_request_ids=columns.pack_ids(list(sampled)),
                          sampled_token_ids=columns.pack_u32(list(sampled.values())))
        self.outbox.put(scheduler_pb2.WorkerMessage(result=scheduler_pb2.StepResult(**result)))

    def answer(self, plan: scheduler_pb2.StepPlan, token: int = 7) -> None:
        """An honest answer: a token for every request that samples."""
        ids = [r.request_id for r in plan.new_requests] + columns.unpack_ids(plan.running.request_ids, "ids")
        self.send(step_id=plan.step_id, sampled={rid: token for rid in ids})

    def closed_with(self) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            while True:
                next(self.plans)
        return info.value

    def close(self) -> None:
        self.outbox.put(None)
        self.plans.cancel()


def wait_replicas(channel, names: set[str], timeout_s: float = 60.0) -> None:
    """Until exactly the replicas `names` are attached (the flight record names them)."""
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = stub.GetFlightRecord(scheduler_pb2.GetFlightRecordRequest(), timeout=10)
        if set(filter(None, record.worker_id.split(","))) == names:
            return
        time.sleep(0.01)
    raise AssertionError(f"replicas {names} never attached alone")


def _submit(session: ConnectSession, rid: str, max_tokens: int = 3) -> None:
    session.submit(scheduler_pb2.SubmitRequest(
        request_id=rid, prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    ))


def unscoped(request_id: str) -> str:
    """The gateway's id of a request the worker knows by its stream-scoped id."""
    return request_id.rsplit("/", 1)[-1]


def _tokens(session: ConnectSession, rid: str) -> list[int]:
    session.last_event(rid)
    return [t for e in session._events[rid] for t in e.token_ids]


def _forged(plan: scheduler_pb2.StepPlan, rid: str) -> dict[str, dict]:
    return {
        "unknown step": dict(step_id=plan.step_id + 1000, sampled={rid: 7}),
        "id it did not schedule": dict(step_id=plan.step_id, sampled={rid: 7, "someone-else": 7}),
        "token outside the vocabulary": dict(step_id=plan.step_id, sampled={rid: VOCAB}),
        "missing token": dict(step_id=plan.step_id),
        "failure of a request it did not run": dict(step_id=plan.step_id, failed={"someone-else": "x"}),
        "more request ids than tokens": dict(step_id=plan.step_id, sampled_request_ids=columns.pack_ids([rid])),
        "a request id twice": dict(step_id=plan.step_id, sampled_request_ids=columns.pack_ids([rid, rid]),
                                   sampled_token_ids=columns.pack_u32([7, 7])),
        "ids not NUL-terminated": dict(step_id=plan.step_id, sampled_request_ids=rid.encode(),
                                       sampled_token_ids=columns.pack_u32([7])),
        "tokens not whole uint32s": dict(step_id=plan.step_id, sampled_request_ids=columns.pack_ids([rid]),
                                         sampled_token_ids=b"\7\0\0"),
        "nan timing": dict(step_id=plan.step_id, sampled={rid: 7},
                           timing=scheduler_pb2.WorkerTiming(forward_start=math.nan)),
    }


FORGERIES = list(_forged(scheduler_pb2.StepPlan(), "x"))


@pytest.fixture
def two_replicas(scheduler, request):
    """A test-driven worker ('forger') and an honest one answering 7s, both attached."""
    _, address = scheduler
    channel = grpc.insecure_channel(address)
    name = request.node.name.replace(" ", "-")
    forger = FakeWorker(channel, worker_id=f"forger-{name}")
    honest = FakeWorker(channel, worker_id=f"honest-{name}", auto_token=7)
    session = ConnectSession(channel)
    try:
        wait_replicas(channel, {f"forger-{name}", f"honest-{name}"})
        yield forger, honest, session
    finally:
        forger.close()
        honest.close()
        session.close()
        channel.close()


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_result_drops_that_replica_only(scheduler, two_replicas, forgery):
    """The forger commits one honest token (9), then forges; its request moves to the honest
    replica and ends [9, 7, 7]: the committed token kept, none twice. The other replica's
    request never notices."""
    proc, _ = scheduler
    forger, honest, session = two_replicas
    _submit(session, "a")
    _submit(session, "b")  # least loaded: one request on each replica
    first = forger.next_plan()
    [scoped] = forger.seen  # the id as the worker sees it: scoped to the gateway's stream
    victim = unscoped(scoped)
    [bystander] = {"a", "b"} - {victim}
    second = forger.next_plan()  # async: the placeholder decode is already planned
    forger.answer(first, token=9)
    forger.send(**_forged(second, scoped)[forgery])
    error = forger.closed_with()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "result" in error.details() or "timing" in error.details(), error.details()
    assert _tokens(session, victim) == [9, 7, 7]
    assert session.last_event(victim).finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert _tokens(session, bystander) == [7, 7, 7]
    assert session.last_event(bystander).finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert victim in map(unscoped, honest.seen) and proc.poll() is None


def test_duplicated_result_drops_the_replica(scheduler, two_replicas):
    forger, honest, session = two_replicas
    _submit(session, "a", max_tokens=5)
    _submit(session, "b", max_tokens=5)
    plan = forger.next_plan()
    [victim] = map(unscoped, forger.seen)
    forger.answer(plan, token=9)
    forger.answer(plan, token=9)  # the same step again
    assert forger.closed_with().code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _tokens(session, victim) == [9, 7, 7, 7, 7]
    [bystander] = {"a", "b"} - {victim}
    assert _tokens(session, bystander) == [7] * 5


def test_a_second_worker_becomes_a_replica_and_protocol_violations_close_the_stream(scheduler):
    _, address = scheduler
    channel = grpc.insecure_channel(address)
    first = FakeWorker(channel, worker_id="first", auto_token=7)
    second = FakeWorker(channel, worker_id="second", auto_token=7)
    try:
        wait_replicas(channel, {"first", "second"})  # both attached: no refusal, no eviction
        other = scheduler_pb2.WorkerHello()
        other.CopyFrom(HELLO)
        other.model_name = "another-model"
        with pytest.raises(grpc.RpcError) as info:
            next(FakeWorker(channel, other).plans)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "model_name" in info.value.details()
        bad = scheduler_pb2.WorkerHello()
        bad.CopyFrom(HELLO)
        bad.block_size = 0
        with pytest.raises(grpc.RpcError) as info:
            next(FakeWorker(channel, bad).plans)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_size" in info.value.details()
        second.close()
        solo = FakeWorker(channel, worker_id="solo")
        wait_replicas(channel, {"first", "solo"})
        solo.outbox.put(scheduler_pb2.WorkerMessage(hello=HELLO))  # a second hello on the stream
        assert solo.closed_with().code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_replicas(channel, {"first"})
    finally:
        first.close()
        second.close()
        channel.close()
