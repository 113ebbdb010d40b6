"""CPU seconds of a process and of its threads, from /proc (what the benchmarks measure
daemons with), and the Python names of a process's threads (from `py-spy dump`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat_seconds(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    return _stat_seconds(Path(f"/proc/{pid}/stat").read_text())


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """OS thread id -> (OS thread name, CPU seconds) of each live thread of `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # the thread ended
        out[int(task.name)] = (stat[stat.index("(") + 1:stat.rindex(")")], _stat_seconds(stat))
    return out


def python_thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from one `py-spy dump` (Python 3.11 does not name
    OS threads); {} when py-spy is not there."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return {}
    dump = subprocess.run([str(spy), "dump", "-p", str(pid)], capture_output=True, text=True, timeout=60).stdout
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"', dump, re.M)}
