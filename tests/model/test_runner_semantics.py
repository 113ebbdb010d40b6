"""Worker-side plan semantics: placeholder inputs come from the device-side sampled ids,
config parsing honours both transformers layouts."""

from __future__ import annotations

import pytest
import torch

from stepahead.plan import NewRequest, RunningRequest, StepPlan
from testing.checkpoints import VARIANTS, build_checkpoint
from tests.model.driver import GREEDY
from worker_service.model_config import ModelConfig
from worker_service.model_runner import ModelRunner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model_type, overrides = VARIANTS["mistral_untied_gqa1"]
    path = tmp_path_factory.mktemp("semantics")
    return path, build_checkpoint(path, model_type, seed=4, **overrides)


def test_placeholder_input_is_read_from_device_sampled_ids(checkpoint):
    path, hf = checkpoint
    prompt = list(range(10, 30))
    runner = ModelRunner(path, num_blocks=8, block_size=8)
    first = runner.execute(StepPlan(0, (NewRequest("a", tuple(prompt), GREEDY, (0, 1, 2), 0, len(prompt)),)))
    token = first.sampled_token_ids["a"]
    runner.requests["a"].token_ids[-1] = (token + 1) % runner.vocab_size  # poison the host copy
    runner.execute(StepPlan(1, running=(RunningRequest("a", (), 1, input_is_placeholder=True),)))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + [token]])).logits[0, -1]
    torch.testing.assert_close(runner.logits_of("a"), expected, rtol=1e-4, atol=1e-4)


def test_sampling_only_when_the_step_covers_the_last_known_token(checkpoint):
    path, _ = checkpoint
    runner = ModelRunner(path, num_blocks=8, block_size=8)
    prompt = tuple(range(1, 21))
    r0 = runner.execute(StepPlan(0, (NewRequest("a", prompt, GREEDY, (0, 1, 2), 0, 8),)))
    r1 = runner.execute(StepPlan(1, running=(RunningRequest("a", (), 8),)))
    r2 = runner.execute(StepPlan(2, running=(RunningRequest("a", (), 4),)))
    assert r0.sampled_token_ids == {} and r1.sampled_token_ids == {}
    assert set(r2.sampled_token_ids) == {"a"} and runner.requests["a"].num_computed == 20
    assert runner.requests["a"].token_ids[-1] == r2.sampled_token_ids["a"]


def test_config_parsing_both_rope_layouts_and_eos():
    base = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, eos_token_id=[2, 3], max_position_embeddings=512)
    old = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}})
    new = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128}})
    assert old.rope == new.rope and new.rope.theta == 5e5 and new.rope.rope_type == "llama3"
    assert new.eos_token_ids == (2, 3) and new.head_dim == 16 and new.num_kv_heads == 4
    assert ModelConfig.from_dict(base, generation_eos=(7,)).eos_token_ids == (7,)


def test_max_model_len_is_every_position_whatever_the_window(checkpoint, tmp_path):
    path, _ = checkpoint
    runner = ModelRunner(path, num_blocks=4)
    assert runner.config.sliding_window == 16
    assert runner.max_model_len == 1024  # max_position_embeddings: windowed attention, not a clamp
    assert runner.eos_token_ids == ()
