"""A stop string that ends a request on a plain decode token (one the scheduler sent in
`EventBatch`'s packed columns, without counts) reports the request's exact usage through the
real daemons: the prompt and cached tokens of the same request ended by the scheduler
(`max_tokens`, a full event) are the oracle. `serve` is the session's (tests/service/conftest.py)."""

from __future__ import annotations

import random

from stepahead.v1 import common_pb2
from tests.fixtures_models import tiny_tokenizer  # noqa: F401
from tests.service.test_e2e import collect, greedy_request

MAX_TOKENS = 24


def stop_piece(tokenizer, tokens: list[int], text: str) -> tuple[int, str]:
    """(k, the text of token k) for the first k >= 2 whose text first appears in `text` where
    token k put it: a stop string met on token k, a plain token (not the first, not the last)."""
    for k in range(2, len(tokens) - 1):
        start = len(tokenizer.decode(tokens[:k], skip_special_tokens=True))
        piece = tokenizer.decode(tokens[:k + 1], skip_special_tokens=True)[start:]
        if piece.strip() and text.startswith(piece, start) and text.find(piece) == start:
            return k, piece
    raise AssertionError(f"no token's text is a usable stop string in {text!r}")


def test_a_stop_string_on_a_plain_token_reports_the_requests_usage(serve, tiny_tokenizer):  # noqa: F811
    prompt = [random.Random(41).randrange(3, len(tiny_tokenizer)) for _ in range(40)]
    tokens, text, _ = collect(serve.gateway, greedy_request(prompt, MAX_TOKENS))  # also fills the prefix cache
    k, stop = stop_piece(tiny_tokenizer, tokens, text)

    _, stopped_text, stopped = collect(serve.gateway, greedy_request(prompt, MAX_TOKENS, stop=[stop]))
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP and stopped_text == text[: text.index(stop)]
    n = stopped.usage.completion_tokens
    assert 2 <= n < MAX_TOKENS, f"ended on token {n}: not a plain one"

    _, _, oracle = collect(serve.gateway, greedy_request(prompt, n))  # ended by the scheduler: a full event
    assert oracle.finish_reason == common_pb2.FINISH_REASON_LENGTH and oracle.usage.completion_tokens == n
    assert stopped.usage.prompt_tokens == oracle.usage.prompt_tokens == len(prompt)
    assert stopped.usage.cached_tokens == oracle.usage.cached_tokens > 0, "the prompt's cached blocks"
