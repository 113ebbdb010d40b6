"""A request the worker cannot sample fails alone: a sampling row that breaks the shared
limits, or a row whose sampling raises, ends that request with a reason; every other row
of the step gets exactly the token it gets without it, and later deltas of the failed
request (planned ahead before the scheduler heard) are skipped, not fatal."""

from __future__ import annotations

import pytest

from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
from testing.checkpoints import VARIANTS, build_checkpoint
from tests.model.driver import GREEDY
from worker_service.model_runner import ModelRunner
from worker_service.sampler import Sampler, seeded_uniform

SEEDED = SamplingParams(temperature=0.9, top_p=0.8, seed=11)
POISON_SEED = 666


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model_type, overrides = VARIANTS["llama_tied_gqa4"]
    path = tmp_path_factory.mktemp("failures")
    build_checkpoint(path, model_type, seed=2, **overrides)
    return path


def _new(rid: str, prompt: tuple[int, ...], sampling: SamplingParams, first_block: int) -> NewRequest:
    return NewRequest(rid, prompt, sampling, (first_block, first_block + 1), 0, len(prompt))


def _two_steps(runner: ModelRunner, extra: list[NewRequest]):
    good = [_new("g", tuple(range(3, 15)), GREEDY, 0), _new("s", tuple(range(20, 29)), SEEDED, 2)]
    first = runner.execute(StepPlan(0, tuple(good[:1] + extra + good[1:])))
    running = tuple(RunningRequest(r.request_id, (), 1, input_is_placeholder=True) for r in good[:1] + extra + good[1:])
    second = runner.execute(StepPlan(1, running=running))
    return first, second


def test_a_bad_sampling_row_fails_alone(checkpoint):
    alone = _two_steps(ModelRunner(checkpoint, num_blocks=16, block_size=8), [])
    bad = _new("bad", (7, 8, 9), SamplingParams(temperature=0.7, top_p=0.0), 4)  # top_p 0: never valid
    first, second = _two_steps(ModelRunner(checkpoint, num_blocks=16, block_size=8), [bad])
    assert "sampling.top_p" in first.failed["bad"] and "bad" not in first.sampled_token_ids
    assert first.sampled_token_ids == alone[0].sampled_token_ids
    assert second.sampled_token_ids == alone[1].sampled_token_ids and not second.failed


class PoisonedSampler(Sampler):
    """Fault injection: raises for any batch holding the row seeded with POISON_SEED (no valid
    input makes the real sampler raise, so the isolation path needs an injected fault)."""

    def __call__(self, logits, meta):
        if meta.seeded_u is not None:
            poison = [seeded_uniform(POISON_SEED, n) for n in range(64)]
            if any(u in poison for u in meta.seeded_u.tolist()):
                raise RuntimeError("injected sampling fault")
        return super().__call__(logits, meta)


def test_a_row_whose_sampling_raises_fails_alone(checkpoint):
    alone = _two_steps(ModelRunner(checkpoint, num_blocks=16, block_size=8), [])
    runner = ModelRunner(checkpoint, num_blocks=16, block_size=8)
    runner.sampler = PoisonedSampler(runner.device)
    poisoned = _new("poisoned", (7, 8, 9), SamplingParams(temperature=0.7, seed=POISON_SEED), 4)
    first, second = _two_steps(runner, [poisoned])
    assert "injected sampling fault" in first.failed["poisoned"]
    assert first.sampled_token_ids == alone[0].sampled_token_ids  # seeded rows are batch-invariant
    assert second.sampled_token_ids == alone[1].sampled_token_ids
    assert "poisoned" not in runner.requests
    runner.execute(StepPlan(2, finished_ids=("poisoned",)))  # the scheduler's forget clears it
    assert not runner._failed_ids
