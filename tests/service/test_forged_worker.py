"""The scheduler never trusts a worker message: a forged or broken `StepResult` closes that
worker's stream with INVALID_ARGUMENT naming the problem, its requests end with ERROR and
a reason, and the scheduler keeps serving (a well-behaved worker attaches and serves next).

The test itself plays the worker on a real scheduler daemon (AttachWorker with a hello),
and a gateway through a raw Connect stream.
"""

from __future__ import annotations

import math
import os
import queue
import subprocess
import sys

import grpc
import pytest

from stepahead.serve import free_port
from stepahead.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.service.streams import ConnectSession, wait_health

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
    proc = subprocess.Popen([sys.executable, "-m", "stepahead.cli", "scheduler", "--port", str(port)], env=env)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        yield proc, address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class FakeWorker:
    """An attach stream driven by the test: receive plans, answer whatever it likes."""

    def __init__(self, channel, hello=HELLO, address: str = "") -> None:
        self.address = address
        self.outbox: queue.Queue = queue.Queue()
        self.outbox.put(scheduler_pb2.WorkerMessage(hello=hello))
        self.plans = scheduler_pb2_grpc.SchedulerStub(channel).AttachWorker(iter(self.outbox.get, None))
        if address:
            wait_health(address, serving=True)  # attached (or another worker is): submissions find one

    def next_plan(self) -> scheduler_pb2.StepPlan:
        return next(self.plans).plan

    def send(self, **result) -> None:
        self.outbox.put(scheduler_pb2.WorkerMessage(result=scheduler_pb2.StepResult(**result)))

    def answer(self, plan: scheduler_pb2.StepPlan, token: int = 7) -> None:
        """An honest answer: a token for every request that samples."""
        ids = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.running]
        self.send(step_id=plan.step_id, sampled_token_ids={rid: token for rid in ids})

    def closed_with(self) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            while True:
                next(self.plans)
        return info.value

    def close(self) -> None:
        """Detach, and wait until the scheduler noticed (it takes one worker at a time)."""
        self.outbox.put(None)
        self.plans.cancel()
        if self.address:
            wait_health(self.address, serving=False)


def _submit(session: ConnectSession, rid: str, max_tokens: int = 3) -> None:
    session.submit(scheduler_pb2.SubmitRequest(
        request_id=rid, prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    ))


def _forged(plan: scheduler_pb2.StepPlan) -> dict[str, dict]:
    rid = plan.new_requests[0].request_id
    return {
        "unknown step": dict(step_id=plan.step_id + 1000, sampled_token_ids={rid: 7}),
        "id it did not schedule": dict(step_id=plan.step_id, sampled_token_ids={rid: 7, "someone-else": 7}),
        "token outside the vocabulary": dict(step_id=plan.step_id, sampled_token_ids={rid: VOCAB}),
        "missing token": dict(step_id=plan.step_id),
        "failure of a request it did not run": dict(step_id=plan.step_id, failed={"someone-else": "x"}),
        "nan timing": dict(step_id=plan.step_id, sampled_token_ids={rid: 7},
                           timing=scheduler_pb2.WorkerTiming(forward_start=math.nan)),
    }


FORGERIES = list(_forged(scheduler_pb2.StepPlan(new_requests=[scheduler_pb2.NewRequest(request_id="x")])))


@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_result_drops_that_worker_only(scheduler, forgery):
    proc, address = scheduler
    channel = grpc.insecure_channel(address)
    session = ConnectSession(channel)
    worker = FakeWorker(channel, address=address)
    try:
        rid = f"victim-{forgery.replace(' ', '-')}"
        _submit(session, rid)
        plan = worker.next_plan()
        worker.send(**_forged(plan)[forgery])
        error = worker.closed_with()
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "result" in error.details() or "timing" in error.details(), error.details()
        event = session.last_event(rid)
        assert event.finish_reason == common_pb2.FINISH_REASON_ERROR and "invalid step result" in event.message
        _honest_worker_serves(channel, address, session, f"after-{rid}")
        assert proc.poll() is None
    finally:
        worker.close()
        session.close()
        channel.close()


def test_duplicated_result_drops_the_worker(scheduler):
    proc, address = scheduler
    channel = grpc.insecure_channel(address)
    session = ConnectSession(channel)
    worker = FakeWorker(channel, address=address)
    try:
        _submit(session, "dup", max_tokens=5)
        plan = worker.next_plan()
        worker.answer(plan)
        worker.answer(plan)  # the same step again
        assert worker.closed_with().code() == grpc.StatusCode.INVALID_ARGUMENT
        assert session.last_event("dup").finish_reason == common_pb2.FINISH_REASON_ERROR
        _honest_worker_serves(channel, address, session, "after-dup")
    finally:
        worker.close()
        session.close()
        channel.close()


def test_second_worker_is_refused_and_protocol_violations_close_the_stream(scheduler):
    _, address = scheduler
    channel = grpc.insecure_channel(address)
    first = FakeWorker(channel, address=address)
    try:
        second = FakeWorker(channel, address=address)
        error = second.closed_with()
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS, error
        first.outbox.put(scheduler_pb2.WorkerMessage(hello=HELLO))  # a second hello on the stream
        assert first.closed_with().code() == grpc.StatusCode.INVALID_ARGUMENT
        bad = scheduler_pb2.WorkerHello()
        bad.CopyFrom(HELLO)
        bad.block_size = 0
        with pytest.raises(grpc.RpcError) as info:
            next(FakeWorker(channel, bad).plans)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_size" in info.value.details()
    finally:
        first.close()
        channel.close()


def _honest_worker_serves(channel, address: str, session: ConnectSession, rid: str) -> None:
    """The scheduler still works: an honest worker attaches and a request completes."""
    worker = FakeWorker(channel, address=address)
    try:
        _submit(session, rid, max_tokens=3)
        for _ in range(3):
            worker.answer(worker.next_plan())
        event = session.last_event(rid)
        assert event.finish_reason == common_pb2.FINISH_REASON_LENGTH, event
    finally:
        worker.close()
