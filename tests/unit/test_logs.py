"""The daemons' JSON log lines (`stepahead.logs`)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_log_line_is_json_with_enums_as_their_values():
    code = ("from stepahead.logs import configure; from stepahead.plan import WorkerRole; "
            "configure('worker').info('attached', role=WorkerRole.PREFILL, other=object())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    (line,) = done.stderr.splitlines()
    event = json.loads(line)
    assert event["role"] == "prefill" and event["event"] == "attached" and event["daemon"] == "worker"
    assert event["other"].startswith("<object object at")  # anything else: its repr, as before
