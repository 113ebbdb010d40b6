"""Session-scoped fixtures several service-test modules share. `tests/service/conftest.py`
registers them: a module just names `serve` / `hf` as arguments (importing them here into a
module would start a second daemon set that lives until the session ends). A test using
`serve` must leave it as it found it: every request finished, every block free, and no daemon
may have logged a warning or an error (`ServeProcess.log_problems`, checked at teardown).
"""

from __future__ import annotations

import openai
import pytest

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.hf_oracle import HFGreedy


@pytest.fixture(scope="session")
def metrics_port() -> int:
    """The shared `serve`'s scheduler --metrics-port."""
    from stepahead.ports import free_port

    return free_port()


@pytest.fixture(scope="session")
def serve(tiny_model_dir, metrics_port):  # noqa: F811
    """`stepahead serve` of the tiny model, 64 sequences per step, scheduler metrics on
    `metrics_port`."""
    with Serve(tiny_model_dir, "--max-num-seqs", "64", "--metrics-port", str(metrics_port),
               capture_stderr=True) as s:
        yield s
        # the fuzz and hostile-input tests send random bytes to every method, the scheduler's
        # and the gateway's: each daemon answers them INVALID_ARGUMENT and logs them rate-limited
        problems = s.log_problems([r'"event": "grpc_message_undecodable"',
                                   # test_trace_cli calls the scheduler with a wrong token on purpose
                                   r'^(?=.*"event": "internal_call_refused")(?=.*GetFlightRecord)'])
        assert not problems, problems


@pytest.fixture(scope="session")
def hf(tiny_model_dir):  # noqa: F811
    """Hugging Face greedy generation of the tiny model (the oracle)."""
    return HFGreedy(tiny_model_dir)


@pytest.fixture(scope="session")
def openai_serve(tiny_model_dir):  # noqa: F811
    """The daemons the OpenAI HTTP tests talk to (their own: they check every block comes back)."""
    with Serve(tiny_model_dir, "--max-num-seqs", "32", capture_stderr=True) as s:
        yield s
        # the structured-output tests send constraints that do not compile, on purpose
        problems = s.log_problems([r'^(?=.*"event": "request_failed")(?=.*does not compile)'])
        assert not problems, problems


@pytest.fixture(scope="session")
def openai_client(openai_serve) -> openai.OpenAI:
    with openai.OpenAI(base_url=openai_serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
