"""Shared pytest setup: the --slow profile and the gpu marker."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

# CI size; `--slow` runs 25x the examples. (500 here cost minutes of `make test` on 2 cores,
# most of them in the stateful scheduler machine, for no bug found past the first 200.)
settings.register_profile(
    "default", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run long tests and the slow hypothesis profile")


def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile("slow" if config.getoption("--slow") else "default")
    if config.getoption("--slow"):  # soak and long hypothesis runs: no per-test timeout
        config.option.timeout = 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="long test: run with --slow")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(skip_slow)
