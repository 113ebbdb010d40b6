"""Test-only randomized delays in the daemons' loops (contention mode of the service tests).

`STEPAHEAD_TEST_JITTER_MS="max_ms:seed"` (e.g. "5:3"), read once when this module is first
imported (at daemon start), makes `maybe_jitter()` sleep a uniformly random 0..max_ms
milliseconds from a generator seeded with `seed` (and the process id, so each daemon draws
its own sequence). Unset, or empty, `maybe_jitter` is a function that does nothing. The
worker calls it once per step it launches, the scheduler's engine once per loop round;
never set it in production.
"""

from __future__ import annotations

import os
import random
import time

ENV = "STEPAHEAD_TEST_JITTER_MS"


def _parse(value: str) -> tuple[float, int]:
    max_ms, _, seed = value.partition(":")
    max_s = float(max_ms) / 1000.0
    if not max_s >= 0.0:
        raise ValueError(f"{ENV}={value!r}: max_ms must be >= 0")
    return max_s, int(seed or 0)


def _make(value: str | None):
    if not value:
        return lambda: None
    max_s, seed = _parse(value)
    rng = random.Random(seed * 1_000_003 + os.getpid())
    uniform, sleep = rng.uniform, time.sleep

    def jitter() -> None:
        sleep(uniform(0.0, max_s))

    return jitter


maybe_jitter = _make(os.environ.get(ENV))
