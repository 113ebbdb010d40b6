"""Raw logprobs (sampled token, top-k, prompt) equal a log-softmax over Hugging Face's logits.

Driven through the toy scheduler: chunked prefill, placeholder decodes, preemption by swap
and by recompute, mixed batches where some requests ask and some do not, penalties and
temperature on (raw logprobs ignore them).
"""

from __future__ import annotations

import pytest
import torch

from stepahead.plan import SamplingParams
from testing.checkpoints import VOCAB, build_checkpoint
from tests.model.driver import GREEDY, ToyRequest, ToyScheduler
from worker_service.model_runner import ModelRunner

ATOL = 1e-4
K = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("lp")
    return path, build_checkpoint(path, "llama", seed=3)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(path, reqs, preempt_every=0, chunk=8):
    runner = ModelRunner(path, num_blocks=64, block_size=4, num_host_blocks=64)
    driver = ToyScheduler(runner, chunk=chunk, token_budget=24, preempt_every=preempt_every)
    for r in reqs:
        driver.add(r)
    sampled = {r.request_id: [] for r in reqs}
    prompt = {r.request_id: {} for r in reqs}
    while driver.waiting or driver.running or driver.swapped or driver._to_forget:
        _, result = driver.step()
        for rid, lp in result.logprobs.items():
            sampled[rid].append(lp)
        for rid, part in result.prompt_logprobs.items():
            for i, e in enumerate(part.entries):
                prompt[rid].setdefault(part.start + i, []).append(e)
        assert set(result.logprobs) <= set(result.sampled_token_ids)
    return driver, sampled, prompt


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)  # [len, vocab]


def _assert_top(entry, row: torch.Tensor, k: int) -> None:
    """Same top-k values; same ids except where a tie (gap < ATOL) makes the order ambiguous."""
    values, ids = row.topk(k)
    assert len(entry.top) == k
    ours_ids = [t for t, _ in entry.top]
    ours_vals = torch.tensor([v for _, v in entry.top])
    torch.testing.assert_close(ours_vals, values, atol=ATOL, rtol=0)
    for j in range(k):
        if ours_ids[j] != ids[j]:
            assert abs(row[ours_ids[j]] - values[j]) < ATOL, (j, ours_ids, ids.tolist())
    for t, v in entry.top:
        assert abs(v - row[t]) < ATOL


@pytest.mark.parametrize("preempt_every", [0, 3])
def test_logprobs_match_hf_log_softmax(checkpoint, preempt_every):
    path, hf = checkpoint
    noisy = SamplingParams(temperature=0.9, seed=7, repetition_penalty=1.5, presence_penalty=0.5,
                           logit_bias=((3, 5.0),), max_tokens=1 << 30, logprobs=K, prompt_logprobs=3)
    reqs = [
        ToyRequest("a", _prompt(1, 29), max_new=10, sampling=noisy),
        ToyRequest("b", _prompt(2, 11), max_new=8),  # asks nothing: same batch
        ToyRequest("c", _prompt(3, 6), max_new=6, arrival_step=2,
                   sampling=SamplingParams(temperature=0.0, max_tokens=1 << 30, logprobs=0)),
    ]
    driver, sampled, prompt = _run(path, reqs, preempt_every)
    if preempt_every:
        assert driver.stats.recomputes and driver.stats.swaps
    assert not sampled["b"] and not prompt["b"] and not prompt["c"]
    for r in driver.finished:
        if r.request_id == "b":
            continue
        lp = _hf_logprobs(hf, r.tokens)
        n_prompt = len(r.prompt)
        assert [e.token_id for e in sampled[r.request_id]] == r.output
        for i, (entry, token) in enumerate(zip(sampled[r.request_id], r.output)):
            row = lp[n_prompt - 1 + i]
            assert abs(entry.logprob - row[token]) < ATOL
            if r.sampling.logprobs:
                _assert_top(entry, row, r.sampling.logprobs)
            else:
                assert entry.top == ()
    # prompt logprobs: every position 1..P-1 exactly once per computation, equal across recomputes
    a = next(r for r in driver.finished if r.request_id == "a")
    lp = _hf_logprobs(hf, a.tokens)
    assert sorted(prompt["a"]) == list(range(1, len(a.prompt)))
    for pos, entries in prompt["a"].items():
        for e in entries:
            assert e.token_id == a.prompt[pos]
            assert abs(e.logprob - lp[pos - 1, a.prompt[pos]]) < ATOL
            _assert_top(e, lp[pos - 1], 3)


def test_no_logprobs_when_nobody_asks(checkpoint):
    path, _ = checkpoint
    driver, sampled, prompt = _run(path, [ToyRequest("x", _prompt(4, 9), max_new=3, sampling=GREEDY)])
    assert driver.runner.logprobs.begin_step(None) is None  # the tracker's early return
    assert sampled == {"x": []} and prompt == {"x": {}}
