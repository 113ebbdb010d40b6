"""Helpers of the OpenAI HTTP service tests (fixtures: `openai_serve`, `openai_client` in
`shared_fixtures.py`)."""

from __future__ import annotations

import contextlib

from tests.model.oracle import TIE_GAP
from tests.service.hf_oracle import HFGreedy

IGNORE_EOS = {"ignore_eos": True}
USER = [{"role": "user", "content": "hi"}]


def hf_text(hf: HFGreedy, tokenizer, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    """(HF's greedy text, the part of it before the first near-tie): ours must start with
    the second and equal the first when there is no tie."""
    tokens, gaps = hf.generate(prompt_ids, max_tokens)
    tie = next((i for i, gap in enumerate(gaps) if gap < TIE_GAP), len(tokens))
    return tokenizer.decode(tokens, skip_special_tokens=True), tokenizer.decode(tokens[:tie], skip_special_tokens=True)


def assert_hf_text(got: str, expected: tuple[str, str]) -> None:
    full, before_tie = expected
    if full == before_tie:
        assert got == full
    else:
        assert got.startswith(before_tie)


@contextlib.contextmanager
def served(model_dir, *flags: str):
    """`stepahead serve` of `model_dir` with `flags` that must log no warning or error."""
    from testing.launcher import ServeProcess

    with ServeProcess(model_dir, *flags, capture_stderr=True) as s:
        yield s
        problems = s.log_problems()
        assert not problems, problems


@contextlib.contextmanager
def openai_client_of(serve):
    """The official `openai` client of a `ServeProcess`'s HTTP API."""
    import openai

    with openai.OpenAI(base_url=serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c
