"""Contention mode of the service tests: every core kept busy, and randomized delays in the
daemons' loops (`stepahead/jitter.py`), the way a shared production host runs them.

    with cpu_burners():                       # one busy-loop process per core, always killed
        with Serve(model, env=jitter_env(seed)) as s: ...

`STEPAHEAD_CONTENTION_SEEDS` (default 2) sets how many seeds the contention tests run;
`STEPAHEAD_CONTENTION_JITTER_MS` (default 3) the most a daemon's loop is delayed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from stepahead.jitter import ENV as JITTER_ENV

BURN_BOUND_S = 600  # each burner's own bound: it ends even if the test process is killed


def seeds() -> list[int]:
    return list(range(int(os.environ.get("STEPAHEAD_CONTENTION_SEEDS", "2"))))


def jitter_env(seed: int, max_ms: float | None = None) -> dict[str, str]:
    """The daemons' environment for randomized loop delays of up to `max_ms`, seeded."""
    if max_ms is None:
        max_ms = float(os.environ.get("STEPAHEAD_CONTENTION_JITTER_MS", "3"))
    return {JITTER_ENV: f"{max_ms}:{seed}"}


@contextlib.contextmanager
def cpu_burners(count: int | None = None):
    """`count` (default: one per core) busy-loop processes while the block runs; killed and
    reaped on the way out, whatever happened."""
    code = f"import time\nend = time.monotonic() + {BURN_BOUND_S}\nwhile time.monotonic() < end: pass\n"
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count or os.cpu_count() or 1):
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
