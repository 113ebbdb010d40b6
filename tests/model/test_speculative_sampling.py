"""Speculative verification keeps the target distribution (chi-square on a small vocabulary).

`Speculator.verify` on fixed logits rows: whatever the drafts, the first token of each run
follows softmax of row 0, and after an accepted first draft the second token follows row 1
(rejection sampling with one-hot drafts, vLLM V1's rule). A request without drafts samples
exactly what the plain sampler does with the same seed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stepahead.plan import SamplingParams
from stepahead.speculative import SpeculativeConfig
from tests.model.test_sampler import assert_follows
from worker_service.input_batch import CachedRequest
from worker_service.logits_processing import LogitsProcessing
from worker_service.sampler import Sampler, SamplingMetadata
from worker_service.speculation import SpecBatch, Speculator

CPU = torch.device("cpu")
VOCAB = 8
TRIALS = 6000
ROWS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.2],
                 [0.0, 2.5, -1.0, 1.0, 0.3, -2.0, 0.8, 0.1],
                 [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]], dtype=np.float32)  # [3, VOCAB]


def fake_runner(seed: int = 7) -> SimpleNamespace:
    return SimpleNamespace(logits_processing=LogitsProcessing(VOCAB, CPU), sampler=Sampler(CPU, seed=seed),
                           vocab_size=VOCAB, device=CPU)


def requests(n: int, params: list[SamplingParams]) -> list[CachedRequest]:
    return [CachedRequest(f"r{i}", [1, 2, 3], params[i], [], 3, num_prompt_tokens=3) for i in range(n)]


def verify(drafts: list[int], params: list[SamplingParams], runner=None) -> np.ndarray:
    """Runs [TRIALS, 1 + len(drafts)] (-1 padded) of one verification batch."""
    spec = Speculator(SpeculativeConfig(len(drafts) or 1), ())
    reqs = requests(len(params), params)
    spec.batch = SpecBatch({r.request_id: list(drafts) for r in reqs})
    logits = torch.from_numpy(np.tile(ROWS[: len(drafts) + 1], (len(reqs), 1)))  # [n * (k + 1), VOCAB]
    _, out = spec.verify(runner or fake_runner(), logits, reqs)
    return out.host[:, 1:].numpy()


def softmax(x: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp((x - x.max()) / temperature)
    return e / e.sum()


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("drafts", [[0, 1], [4, 3], [7]])
def test_runs_follow_the_target(seeded, drafts):
    params = [SamplingParams(temperature=1.0, seed=s if seeded else None, max_tokens=50) for s in range(TRIALS)]
    runs = verify(drafts, params)
    assert_follows(runs[:, 0], softmax(ROWS[0]))
    if len(drafts) > 1:
        second = runs[runs[:, 0] == drafts[0], 1]
        assert len(second) > 100, "too few accepted first drafts to test the second position"
        assert_follows(second, softmax(ROWS[1]))


def test_truncation_and_temperature_apply_to_every_position():
    params = [SamplingParams(temperature=0.7, top_k=3, seed=s, max_tokens=50) for s in range(TRIALS)]
    runs = verify([5, 1], params)
    for row, tokens in ((0, runs[:, 0]), (1, runs[runs[:, 0] == 5, 1])):
        probs = softmax(ROWS[row], 0.7)
        probs[np.argsort(ROWS[row])[:-3]] = 0.0
        assert_follows(tokens, probs / probs.sum())


def test_greedy_accepts_the_argmax_prefix():
    params = [SamplingParams(temperature=0.0, max_tokens=50)] * 3
    argmax = ROWS.argmax(axis=1).tolist()  # [0, 1, 0]
    got = verify([argmax[0], argmax[1]], params)
    assert got[0].tolist() == argmax  # both accepted + the bonus
    got = verify([argmax[0], 6], params)
    assert got[0].tolist() == [argmax[0], argmax[1], -1]  # the second rejected: replaced by the argmax


def test_no_drafts_samples_what_the_sampler_samples():
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=s, max_tokens=50) for s in range(500)]
    runs = verify([], params)
    logits = torch.from_numpy(np.tile(ROWS[:1], (len(params), 1)))
    meta = SamplingMetadata.build(params, [3] * len(params), VOCAB, CPU)
    assert runs[:, 0].tolist() == Sampler(CPU).__call__(logits, meta).tolist()
