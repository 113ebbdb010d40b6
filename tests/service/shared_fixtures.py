"""Module-scoped fixtures several service-test modules share; import them into a module:

    from tests.service.shared_fixtures import hf, serve  # noqa: F401
"""

from __future__ import annotations

import pytest

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.hf_oracle import HFGreedy


@pytest.fixture(scope="module")
def serve(tiny_model_dir):  # noqa: F811
    """`stepahead serve` of the tiny model, 64 sequences per step."""
    with Serve(tiny_model_dir, "--max-num-seqs", "64") as s:
        yield s


@pytest.fixture(scope="module")
def hf(tiny_model_dir):  # noqa: F811
    """Hugging Face greedy generation of the tiny model (the oracle)."""
    return HFGreedy(tiny_model_dir)
