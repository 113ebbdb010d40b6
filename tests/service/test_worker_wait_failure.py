"""Issue 15, finding 1: an asynchronous device error surfaces in `PendingStep.wait()` on the
worker's sender thread (on CUDA; on CPU errors surface in `launch`, so it is injected
here). The scheduler, played by the test on a real gRPC server, must get a `fatal_error`
naming it and see the stream close (never a silent hang), and the worker must reset and
re-attach cleanly: the same request id is accepted again and runs.
"""

from __future__ import annotations

import json
import queue
import threading
from concurrent import futures

import grpc
import pytest
import structlog.testing

from stepahead import columns, logs
from testing.launcher import problem_lines
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from worker_service import daemon, model_runner

TIMEOUT_S = 60


def _plan() -> scheduler_pb2.StepPlan:
    return scheduler_pb2.StepPlan(step_id=0, new_requests=[scheduler_pb2.NewRequest(
        request_id="r", token_ids=[5, 6, 7], block_ids=[0], num_computed_tokens=0, num_scheduled_tokens=3, num_prompt_tokens=3,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4))])


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Every attach: one plan with request "r"; the worker's answer to session i (and whether
    the stream then ended) goes to `sessions[i]`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: list[queue.Queue] = [queue.Queue() for _ in range(8)]
        self.count = 0

    def AttachWorker(self, request_iterator, context):
        with self.lock:
            index, self.count = self.count, self.count + 1
        hello = next(request_iterator)
        assert hello.HasField("hello")
        yield scheduler_pb2.SchedulerMessage(plan=_plan())
        reply = next(request_iterator, None)
        self.sessions[index].put(reply)
        try:
            self.sessions[index].put(next(request_iterator, None) is None)  # the stream ended
        except grpc.RpcError:  # cancelled by the worker: ended too
            self.sessions[index].put(True)


def test_a_failure_in_wait_is_reported_and_the_worker_reattaches(tiny_model_dir, monkeypatch):  # noqa: F811
    real_wait = model_runner.PendingStep.wait
    calls = []

    def failing_once(self):
        calls.append(self.step_id)
        if len(calls) == 1:
            raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")
        return real_wait(self)

    monkeypatch.setattr(model_runner.PendingStep, "wait", failing_once)
    scripted = ScriptedScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scripted, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stop = threading.Event()
    config = daemon.WorkerConfig(scheduler=f"127.0.0.1:{port}", model=str(tiny_model_dir), num_threads=1)
    log = logs.configure("worker", "warning")
    captured = structlog.testing.capture_logs()  # the worker's events, as dicts (this test runs it in process)
    events = captured.__enter__()
    worker = threading.Thread(target=daemon.serve, args=(config, stop, log))
    worker.start()
    try:
        first = scripted.sessions[0].get(timeout=TIMEOUT_S)  # a hang fails here
        assert first is not None and first.HasField("fatal_error"), first
        assert "wait" in first.fatal_error and "illegal memory access" in first.fatal_error
        assert scripted.sessions[0].get(timeout=TIMEOUT_S), "the stream must end after a fatal error"
        second = scripted.sessions[1].get(timeout=TIMEOUT_S)  # re-attached, state reset: "r" is new again
        assert second is not None and second.HasField("result"), second
        assert columns.unpack_ids(second.result.sampled_request_ids, "ids") == ["r"]
    finally:
        stop.set()
        worker.join(timeout=TIMEOUT_S)
        server.stop(0)
        captured.__exit__(None, None, None)
    assert not worker.is_alive()
    assert len(calls) >= 2
    # the injected failure is logged (the step, the session); nothing else at warning or above
    lines = [json.dumps(dict(e, level=e.get("log_level")), default=str) for e in events]
    problems = problem_lines(lines, [r'^(?=.*"event": "(step_failed|attach_session_failed)")(?=.*illegal memory access)'])
    assert not problems, problems
    assert any("illegal memory access" in line for line in lines), "the injected failure was not logged"


if __name__ == "__main__":
    pytest.main([__file__])
