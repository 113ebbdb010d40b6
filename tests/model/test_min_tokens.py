"""min_tokens keeps EOS and stop tokens from being sampled until enough output exists."""

from __future__ import annotations

import pytest

from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
from testing.checkpoints import build_checkpoint
from worker_service.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("min-tokens-llama")
    build_checkpoint(path, "llama", seed=11)
    return path


def generate(runner: ModelRunner, prompt: list[int], sampling: SamplingParams, steps: int) -> list[int]:
    runner.reset()
    out = [runner.execute(StepPlan(0, new_requests=(
        NewRequest("r", tuple(prompt), sampling, tuple(range(8)), 0, len(prompt), len(prompt)),))).sampled_token_ids["r"]]
    for t in range(1, steps):
        out.append(runner.execute(StepPlan(t, running=(RunningRequest("r", (), 1),))).sampled_token_ids["r"])
    return out


def test_stop_token_is_masked_until_min_tokens(model_dir):
    runner = ModelRunner(model_dir, block_size=4, num_blocks=16)
    prompt = [5, 6, 7, 8]
    free = generate(runner, prompt, SamplingParams(temperature=0.0, max_tokens=12), 12)
    stop = free[1]  # greedy emits it as the second token when nothing is masked
    masked = generate(runner, prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6,
                                                     stop_token_ids=(stop,)), 12)
    assert stop not in masked[:6]
    assert masked[0] == free[0]


def test_eos_is_masked_unless_ignore_eos(model_dir):
    runner = ModelRunner(model_dir, block_size=4, num_blocks=16)
    prompt = [9, 10, 11]
    free = generate(runner, prompt, SamplingParams(temperature=0.0, max_tokens=8), 8)
    runner.eos_token_ids = (free[0],)  # pretend the first greedy token is the model's EOS
    held = generate(runner, prompt, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3), 8)
    assert free[0] not in held[:3]
    ignored = generate(runner, prompt, SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                                                      ignore_eos=True), 8)
    assert ignored == free
