"""What the benchmarks read of the machine: CPU seconds of a process and of its threads, the
time its threads waited for a CPU (/proc), the Python names of a process's threads
(`py-spy dump`), and its speed now.

Two speed measures, both kept because results on disk carry them: `calibration_us`, the best
of many short runs of `sum(range(10_000))` (wall µs: the machine's floor), recorded by the
per-step microbenchmarks; `python_speed_ms`, the median CPU ms of a longer loop, recorded per
capacity run (what a daemon's work costs at that moment: a shared VM's vCPUs change speed
from minute to minute, and both measures follow it).
"""

from __future__ import annotations

import os
import re
import bisect
import subprocess
import sys
import threading
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


def py_spy() -> Path | None:
    """The py-spy beside this interpreter (`pip install py-spy` into the venv), or None."""
    spy = Path(sys.executable).with_name("py-spy")
    return spy if spy.exists() else None


def python_thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from one `py-spy dump` (Python 3.11 does not name
    OS threads); {} when py-spy is not there."""
    spy = py_spy()
    if spy is None:
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


def runqueue_wait_seconds(pid: int) -> float:
    """Seconds the threads of process `pid` have spent runnable but waiting for a CPU, summed
    over its live threads (/proc's schedstat, second field: the scheduler's run-queue wait).
    Two threads waiting at once count twice; a thread that ended is no longer counted."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
    return total / 1e9


class CpuSampler:
    """A process's CPU seconds and its threads' run-queue wait (`runqueue_wait_seconds`)
    sampled every `interval_s` on a background thread, against the wall clock (`time.time()`,
    the flight recorder's clock), to read either over a time window afterwards (/proc's CPU
    resolution is one clock tick, 10 ms: read windows of seconds)."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self._pid, self._interval_s = pid, interval_s
        self._times: list[float] = []
        self._cpu: list[float] = []
        self._wait: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                cpu, wait = cpu_seconds(self._pid), runqueue_wait_seconds(self._pid)
            except (FileNotFoundError, ProcessLookupError):
                return  # the process ended
            self._times.append(time.time())
            self._cpu.append(cpu)
            self._wait.append(wait)
            if self._stop.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_between(self, start: float, end: float) -> float | None:
        """CPU seconds spent in [start, end] (interpolated between samples); None when the
        window is not inside the sampled time."""
        return self._between(self._cpu, start, end)

    def wait_between(self, start: float, end: float) -> float | None:
        """Run-queue wait (thread-seconds) in [start, end], as `cpu_between`."""
        return self._between(self._wait, start, end)

    def _between(self, series: list[float], start: float, end: float) -> float | None:
        if not self._times or start < self._times[0] or end > self._times[-1]:
            return None
        return self._at(series, end) - self._at(series, start)

    def _at(self, series: list[float], t: float) -> float:
        i = bisect.bisect_right(self._times, t)
        if i == len(self._times):
            return series[-1]
        t0, t1, c0, c1 = self._times[i - 1], self._times[i], series[i - 1], series[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1
