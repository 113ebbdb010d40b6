"""A real worker daemon against a scheduler played by the test (a real gRPC server on
127.0.0.1): attach sessions that end, half of them with a plan the worker cannot run,
must leave no thread behind (the finding: 12 → 158 threads after 145 crashes), and a
failed step must reach the scheduler as a `fatal_error` with its reason before the stream
closes (never a silent hang)."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc

from stepahead import columns
from testing.launcher import DaemonLogs
from stepahead.ports import free_port
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401

SESSIONS = 21
# the worker logs each plan it refuses (the ghost request) as a failed step and a failed session
EXPECTED_LOGS = [r'^(?=.*"event": "(step_failed|attach_session_failed)")(?=.*ghost)']


def thread_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Each attach: one empty plan (answered), the worker's thread count is taken, then the
    session ends: even sessions close normally, odd ones send a plan the worker must refuse."""

    def __init__(self, worker_pid: list[int]) -> None:
        self.worker_pid = worker_pid
        self.threads: list[int] = []
        self.fatal_errors: list[str] = []
        self.done = threading.Event()

    def AttachWorker(self, request_iterator, context):
        hello = next(request_iterator)
        assert hello.HasField("hello")
        yield scheduler_pb2.SchedulerMessage(plan=scheduler_pb2.StepPlan(step_id=0))
        result = next(request_iterator)
        assert result.HasField("result") and result.result.step_id == 0
        self.threads.append(thread_count(self.worker_pid[0]))
        if len(self.threads) % 2:  # a running delta for a request the worker never saw
            bad = scheduler_pb2.StepPlan(step_id=1, running=scheduler_pb2.RunningDeltas(
                request_ids=columns.pack_ids(["ghost"]), num_scheduled_tokens=columns.pack_u32([1]),
                input_is_placeholder=columns.pack_flags([False]), num_draft_tokens=columns.pack_u32([0]),
                num_new_blocks=columns.pack_u32([0])))
            yield scheduler_pb2.SchedulerMessage(plan=bad)
            reply = next(request_iterator, None)
            self.fatal_errors.append(reply.fatal_error if reply is not None else "<stream closed>")
        if len(self.threads) >= SESSIONS:
            self.done.set()


def test_worker_restarts_leak_no_thread_and_report_failures(tiny_model_dir):  # noqa: F811
    port = free_port()
    pid: list[int] = []
    scripted = ScriptedScheduler(pid)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scripted, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    logs = DaemonLogs(log_level="warning")
    worker = logs.spawn("worker", "--scheduler", f"127.0.0.1:{port}", "--model", str(tiny_model_dir))
    pid.append(worker.pid)
    try:
        assert scripted.done.wait(300), f"only {len(scripted.threads)} attach sessions"
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        server.stop(0)
    first, last = scripted.threads[0], scripted.threads[SESSIONS - 1]
    assert last <= first + 1, f"threads per session: {scripted.threads}"
    assert len(scripted.fatal_errors) == (SESSIONS + 1) // 2
    assert all("ghost" in e for e in scripted.fatal_errors), scripted.fatal_errors
    problems = logs.problems(EXPECTED_LOGS)
    assert not problems, problems
