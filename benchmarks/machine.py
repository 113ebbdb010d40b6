"""What the benchmarks read of the machine: CPU seconds of a process and of its threads
(/proc), the Python names of a process's threads (`py-spy dump`), and its speed now.

Two speed measures, both kept because results on disk carry them: `calibration_us`, the best
of many short runs of `sum(range(10_000))` (wall µs: the machine's floor), recorded by the
per-step microbenchmarks; `python_speed_ms`, the median CPU ms of a longer loop, recorded per
capacity run (what a daemon's work costs at that moment: this VM's two vCPUs change speed by
~2x from minute to minute, and both measures follow it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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


def calibration_us(iters: int = 200) -> float:
    """Best wall time of `sum(range(10_000))` over `iters` runs, µs."""
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter_ns()
        sum(range(10_000))
        best = min(best, time.perf_counter_ns() - t)
    return round(best / 1e3, 1)


def python_speed_ms() -> float:
    """Median CPU ms of three runs of a fixed pure-Python loop (integer arithmetic and dict
    inserts)."""
    def once() -> float:
        t, s, d = time.process_time(), 0, {}
        for i in range(2_000_000):
            s += i * i
        for i in range(200_000):
            d[i] = (i, str(i))
        return (time.process_time() - t) * 1e3
    return sorted(once() for _ in range(3))[1]
