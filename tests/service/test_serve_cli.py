"""`stepahead serve` lifecycle and the `stepahead generate` client, as a user runs them."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from stepahead.v1 import common_pb2
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.service.harness import Serve
from tests.service.streams import greedy, wait_health


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_generate_cli_json_and_sigterm_leaves_no_process(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    serve = Serve(tiny_model_dir)
    try:
        children = serve.child_pids()
        assert len(children) == 3, f"expected scheduler, worker and gateway, got {children}"
        out = subprocess.run(
            [sys.executable, "-m", "cli", "generate", "--target", serve.gateway_addr, "--json",
             "--temperature", "0", "--max-tokens", "12", "--ignore-eos", "import os"],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout
        messages = [json.loads(line) for line in out.splitlines()]
        final = messages[-1]
        assert final["finish_reason"] == "FINISH_REASON_LENGTH"
        assert int(final["usage"]["completion_tokens"]) == 12
        ids = [int(t) for m in messages for t in m.get("token_ids", [])]
        assert "".join(m.get("text", "") for m in messages) == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        code = serve.proc.wait(timeout=60)
    assert code == 0
    assert [pid for pid in children if _alive(pid)] == [], "daemons survived SIGTERM"


def test_serve_restarts_a_daemon_that_dies(tiny_model_dir):  # noqa: F811
    """kill -9 of the scheduler: serve restarts it, the worker re-attaches, the gateway
    reconnects, and the system serves again (instead of the whole system stopping)."""
    with Serve(tiny_model_dir) as serve:
        scheduler_pid = serve.child_pids()[0]
        pidfd = os.pidfd_open(scheduler_pid)
        os.kill(scheduler_pid, signal.SIGKILL)
        assert select.select([pidfd], [], [], 30)[0], "the scheduler did not die"  # readable once it exited
        os.close(pidfd)
        wait_health(serve.scheduler_addr, serving=True)  # restarted, and a worker attached again
        request = greedy([5, 6, 7], 4)
        for attempt in range(50):  # the gateway's stream to the old scheduler may break once
            try:
                messages = list(serve.gateway.Generate(request, timeout=60))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert serve.proc.poll() is None and scheduler_pid not in serve.child_pids()
