"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest

from worker_service import cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    """The built CPU kernels (built on first use, not at collection); skipped where this machine
    has no C++ compiler, as the worker then serves with torch's ops."""
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the CPU kernels could not be built here (no compiler)")
    return module
