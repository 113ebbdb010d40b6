"""`serve`'s restart policy for a daemon that dies (`cli.serve.restart_delay`).

Finding covered: the restart count never started over, so a long-running `serve` whose
daemons crashed now and then (a worker's out-of-memory once a week) waited the longest backoff
before every restart after the sixth, and shut itself down at the eleventh crash however far
apart the crashes were.
"""

from __future__ import annotations

from cli.serve import HEALTHY_RUN_S, MAX_BACKOFF_S, Child, restart_delay


def _child(restarts: int, started_at: float) -> Child:
    return Child("worker", [], None, {}, restarts=restarts, started_at=started_at)


def test_a_crash_loop_backs_off_then_gives_up():
    child = _child(0, started_at=100.0)
    delays = []
    for _ in range(4):
        delays.append(restart_delay(child, child.started_at + 1.0, max_restarts=4))
        child.restarts += 1  # what supervise does when it starts it again
        child.started_at += 2.0
    assert delays == [0.5, 1.0, 2.0, 4.0]
    assert restart_delay(child, child.started_at + 1.0, max_restarts=4) is None  # died 5 times in a row
    assert restart_delay(_child(20, 0.0), 1.0, max_restarts=30) == MAX_BACKOFF_S


def test_a_daemon_that_ran_a_while_before_it_died_starts_the_count_over():
    child = _child(10, started_at=1000.0)  # ten restarts in a row earlier: one more would be the end
    assert restart_delay(child, 1000.0 + HEALTHY_RUN_S - 1.0, max_restarts=10) is None
    child = _child(10, started_at=1000.0)
    assert restart_delay(child, 1000.0 + HEALTHY_RUN_S, max_restarts=10) == 0.5  # a new incident
    assert child.restarts == 0
