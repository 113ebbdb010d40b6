"""The CPU kernels' build guard (`worker_service/cpu_kernels.py`): a build killed mid-way (a worker
stopped while it compiled) leaves torch's `lock` file in the build directory; the next process
to load the kernels must not wait on it forever.

Findings covered: after a worker was killed while it built the kernels, every later worker on
the host hung at start-up in torch's `FileBaton.wait`, and `serve` never became ready. And a
checkout of the same sources at another path, or another venv, rebuilt the shared build (~45 s),
then the first one's next load rebuilt it again: torch's build file held each checkout's absolute
source paths and each venv's torch paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_another_checkout_of_the_same_sources_loads_the_build_without_rebuilding(kernels, tmp_path):
    # `kernels`: built in this process first; another checkout's copy of csrc, loaded in a new process
    other = tmp_path / "checkout" / "csrc"
    other.mkdir(parents=True)
    for path in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        (other / path.name).write_bytes(path.read_bytes())
    library = next(cpu_kernels.build_dir().glob("*.so"))
    before = library.stat().st_mtime_ns
    code = ("from pathlib import Path; from worker_service import cpu_kernels\n"
            f"csrc = Path({str(other)!r})\n"
            "cpu_kernels.SOURCES = tuple(csrc / p.name for p in cpu_kernels.SOURCES)\n"
            "cpu_kernels.HEADERS = tuple(csrc / p.name for p in cpu_kernels.HEADERS)\n"
            "assert cpu_kernels.build_dir().name == " + repr(cpu_kernels.build_dir().name) + "\n" + LOAD)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    assert library.stat().st_mtime_ns == before, "the other checkout rebuilt the kernels"


def test_each_torch_installation_builds_apart(monkeypatch):
    mine = cpu_kernels.build_dir()
    monkeypatch.setattr(cpu_kernels, "_torch_dir", lambda: "/another/venv/lib/python3.11/site-packages/torch")
    assert cpu_kernels.build_dir() != mine  # another venv's build never replaces this one's
