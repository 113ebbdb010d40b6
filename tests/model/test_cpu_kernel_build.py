"""The CPU kernels' build guard (`worker_service/cpu_kernels.py`): a build killed mid-way (a worker
stopped while it compiled) leaves torch's `lock` file in the build directory; the next process
to load the kernels must not wait on it forever.

Finding covered: after a worker was killed while it built the kernels, every later worker on
the host hung at start-up in torch's `FileBaton.wait`, and `serve` never became ready."""

from __future__ import annotations

import subprocess
import sys

from worker_service import cpu_kernels

LOAD = "from worker_service import cpu_kernels; assert cpu_kernels.load() is not None; print('loaded')"


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load(kernels):
    # `kernels`: built in this process first, so the one below only loads
    baton = cpu_kernels.build_dir() / "lock"
    with cpu_kernels._exclusive(cpu_kernels.build_dir()):  # as a builder holds it when it is killed
        baton.touch()
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
        assert not baton.exists()
    finally:
        baton.unlink(missing_ok=True)  # never leave the cache poisoned for the tests after this one


def test_a_load_waits_for_a_live_builder_and_says_so(kernels):
    code = "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n" + LOAD
    with cpu_kernels._exclusive(cpu_kernels.build_dir()):  # a live builder
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()  # blocks until the loader says why it waits
            assert "waiting for another process" in first, first
            assert proc.poll() is None  # still waiting: the builder holds the lock
        except BaseException:
            proc.kill()
            raise
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "loaded" in out, out
