"""Launch `stepahead serve` as a subprocess and wait until it is ready (tests, benchmarks).

    with ServeProcess(model_dir, "--max-num-seqs", "64") as s:
        s.gateway.Generate(...); s.stats()
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import grpc

from stepahead import security
from stepahead.ports import free_port
from stepahead.v1 import generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

_PROBLEM_LEVELS = frozenset({"warning", "error", "critical", "exception"})
_PROBLEM_TEXT = re.compile(r"Traceback|Error|Exception")

READY = re.compile(r"stepahead ready: gateway at (\S+) \(scheduler at (\S+)\)(?: http at (\S+))?")



def _continues_traceback(line: str) -> bool:
    return (not line.strip() or line[:1].isspace() or line.startswith(("Traceback", "During handling of the above",
                                                                       "The above exception")))


def problem_lines(lines: Iterable[str], expected: Iterable[str] = ()) -> list[str]:
    """The log lines that say something went wrong and match none of the `expected` regular
    expressions: a structured event at warning or above, or a line that is not one of ours
    and carries a traceback or an error. A plain-text traceback (an uncaught exception in a
    thread, say) is one entry, from its first line to the exception's, so that an expected
    pattern can name the exception."""
    allowed, problems = [re.compile(e) for e in expected], []
    block: list[str] | None = None  # the plain-text traceback being read

    def judge(entry: str, bad: bool) -> None:
        if bad and not any(a.search(entry) for a in allowed):
            problems.append(entry)

    for line in list(lines):
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if isinstance(event, dict):  # one of ours (it may come between a traceback's lines)
            judge(line.rstrip(), event.get("level") in _PROBLEM_LEVELS)
            continue
        if block is not None:
            block.append(line.rstrip())
            if not _continues_traceback(line):  # the exception's own line ends it
                judge("\n".join(block), True)
                block = None
            continue
        if line.startswith(("Traceback (most recent call last)", "Exception in thread")):
            block = [line.rstrip()]
            continue
        judge(line.rstrip(), _PROBLEM_TEXT.search(line) is not None)
    if block is not None:
        judge("\n".join(block), True)
    return problems


class DaemonLogs:
    """Daemons started one by one (`stepahead scheduler|worker|gateway ...`) with their logs
    kept: `spawn` returns the Popen, `problems(expected)` what `problem_lines` finds in every
    daemon's log so far, each line prefixed with the daemon's command. `expected` defaults to
    the `expected` attribute (a test that kills a daemon on purpose adds what that logs)."""

    def __init__(self, log_level: str = "warning", env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ, STEPAHEAD_LOG_LEVEL=log_level, **(env or {}))
        self.expected: list[str] = []
        self.lines: list[str] = []
        self._readers: list[tuple[subprocess.Popen, threading.Thread]] = []

    def spawn(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "cli", *args], stderr=subprocess.PIPE, text=True,
                                env=dict(self.env, **(env or {})))
        reader = threading.Thread(target=self._read, args=(args[0] if args else "?", proc), daemon=True)
        reader.start()
        self._readers.append((proc, reader))
        return proc

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.append(f"[{name} {proc.pid}] {line}")
            sys.stderr.write(line)  # still shown (pytest shows it with a failure)

    def problems(self, expected: Iterable[str] | None = None, settle_s: float = 5.0) -> list[str]:
        """The readers of daemons that have exited get `settle_s` to take their last lines."""
        for proc, reader in self._readers:
            if proc.poll() is not None:
                reader.join(settle_s)
        by_daemon: dict[str, list[str]] = {}
        for line in list(self.lines):
            tag, raw = line.split("] ", 1)
            by_daemon.setdefault(tag + "]", []).append(raw)
        expected = self.expected if expected is None else expected
        return [f"{tag} {entry}" for tag, raw in by_daemon.items() for entry in problem_lines(raw, expected)]


class ServeProcess:
    """`stepahead serve` with the given flags; `.gateway` / `.scheduler` are gRPC stubs."""

    def __init__(self, model_dir: Path | str, *flags: str, startup_timeout_s: float = 300.0,
                 log_level: str = "warning", env: dict[str, str] | None = None, capture_stderr: bool = False) -> None:
        self.cluster_token = secrets.token_urlsafe(16)  # the internal plane's credential
        env = dict(os.environ, STEPAHEAD_LOG_LEVEL=log_level, STEPAHEAD_CLUSTER_TOKEN=self.cluster_token, **(env or {}))
        if "--http-port" not in flags:
            flags = ("--http-port", str(free_port()), *flags)
        if "--served-model-name" not in flags:  # the tests name a model by its directory ("tiny")
            flags = ("--served-model-name", Path(model_dir).name, *flags)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--model", str(model_dir), "--port", "0", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE if capture_stderr else None, text=True, env=env,
        )
        self.stderr_lines: list[str] = []  # every daemon's log lines, with capture_stderr
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True) if capture_stderr else None
        if self._stderr_reader is not None:
            self._stderr_reader.start()
        self.gateway_addr, self.scheduler_addr, self.http_url = self._wait_ready(startup_timeout_s)
        self._channels = [grpc.insecure_channel(self.gateway_addr), self.scheduler_channel()]
        self.gateway = generation_pb2_grpc.GenerationStub(self._channels[0])
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._channels[1])

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)
            sys.stderr.write(line)  # still shown (pytest shows it with a failure)

    def log_problems(self, expected: Iterable[str] = ()) -> list[str]:
        """The daemons' log lines (with capture_stderr) that say something went wrong and
        match none of the `expected` regular expressions (`problem_lines`). A crash that a
        retry or a resubmission hid from the client is still a crash."""
        return problem_lines(self.stderr_lines, expected)

    def _wait_ready(self, timeout_s: float) -> tuple[str, str, str | None]:
        found: list[tuple[str, str, str | None]] = []
        done = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                m = READY.search(line)
                if m:
                    found.append((m.group(1), m.group(2), m.group(3)))
                    done.set()
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout_s) or not found:
            self.close()
            tail = "".join(self.stderr_lines[-20:])  # with capture_stderr: why (the daemons' last lines)
            raise RuntimeError(f"stepahead serve did not become ready (exit code {self.proc.poll()})"
                               + (f":\n{tail}" if tail else ""))
        return found[0]

    def scheduler_channel(self) -> grpc.Channel:
        """A channel to the scheduler carrying this system's cluster token."""
        return security.channel(self.scheduler_addr, cluster_token=self.cluster_token)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        return self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)

    def child_pids(self) -> list[int]:
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return sorted(pids)

    def close(self) -> None:
        """Stop every daemon; with capture_stderr, `stderr_lines` then holds their last lines too."""
        for ch in getattr(self, "_channels", []):
            ch.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        if self._stderr_reader is not None:
            self._stderr_reader.join(30)  # the pipe ends once serve and its daemons have exited

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
