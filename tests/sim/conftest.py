"""Fixtures of the sim tests: the built-in `llama3-8b-sim` directory and a fast profile file."""

from __future__ import annotations

import json

import pytest

from tests.fixtures_models import built_model_dir


@pytest.fixture(scope="session")
def sim_model_dir(tmp_path_factory):
    """config.json of Llama-3-8B + the built-in tokenizer (no weights)."""
    return built_model_dir("llama3-8b-sim", tmp_path_factory)


@pytest.fixture(scope="session")
def fast_profile(tmp_path_factory):
    """A JSON profile 1000x faster than an H200: steps of microseconds, so tests run many."""
    path = tmp_path_factory.mktemp("sim-profile") / "fast.json"
    path.write_text(json.dumps({
        "memory_bytes": 141e9, "memory_bandwidth": 4.8e15, "peak_flops": 989e15,
        "host_link_bandwidth": 64e12, "step_overhead_s": 1e-5,
    }))
    return path
