"""Bad checkpoints and bad plans fail with an exception that names the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from stepahead.plan import NewRequest, RunningRequest, StepPlan
from testing.checkpoints import VARIANTS, build_checkpoint
from tests.model.driver import GREEDY
from worker_service.model_runner import ModelRunner
from worker_service.plan_checks import PlanError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model_type, overrides = VARIANTS["llama_tied_gqa4"]
    path = tmp_path_factory.mktemp("bad") / "ok"
    build_checkpoint(path, model_type, **overrides)
    return path


@pytest.fixture
def copy(checkpoint, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(checkpoint, dst)
    return dst


@pytest.fixture(scope="module")
def runner(checkpoint):
    return ModelRunner(checkpoint, num_blocks=8, block_size=4, max_model_len=24)


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_type(copy):
    edit_config(copy, model_type="gpt_neox")
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported"):
        ModelRunner(copy, num_blocks=4)


def test_unsupported_rope_type(copy):
    edit_config(copy, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope type 'proportional'"):
        ModelRunner(copy, num_blocks=4)


def test_unknown_dtype(checkpoint):
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        ModelRunner(checkpoint, dtype="float8", num_blocks=4)


def test_missing_weights(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        ModelRunner(copy, num_blocks=4)


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelRunner(copy, num_blocks=4)


def test_truncated_weights(copy):
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is truncated or corrupt"):
        ModelRunner(copy, num_blocks=4)


def test_missing_shard(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(checkpoint).save_pretrained(tmp_path / "s", max_shard_size="100KB")
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "s" / victim).unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: .*{victim}"):
        ModelRunner(tmp_path / "s", num_blocks=4)


def test_missing_tensor(copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for: \\['model.layers.1.self_attn.qkv_proj.weight'\\]"):
        ModelRunner(copy, num_blocks=4)


def test_max_model_len_beyond_model(checkpoint):
    with pytest.raises(ValueError, match="max_model_len 5000 outside"):
        ModelRunner(checkpoint, num_blocks=4, max_model_len=5000)


def new(rid, tokens, blocks, scheduled=None, computed=0):
    return NewRequest(rid, tuple(tokens), GREEDY, tuple(blocks), computed, len(tokens) - computed if scheduled is None else scheduled)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (StepPlan(0, (new("a", range(9), [0, 1]),)),
         "'a': block table of 2 blocks .* too short for 9 tokens"),
        (StepPlan(0, (new("a", range(25), range(7)),)), "'a': position 24 >= max model length 24"),
        (StepPlan(0, (new("a", range(3), [8]),)), "'a': block ids \\[8\\] outside the device pool"),
        (StepPlan(0, (new("a", range(3), [0], scheduled=4),)), "'a': step computes tokens up to 4 but"),
        (StepPlan(0, (new("a", range(3), [0], scheduled=0),)), "'a': num_scheduled_tokens must be >= 1"),
        (StepPlan(0, running=(RunningRequest("ghost", (), 1),)), "running request 'ghost' is unknown"),
        (StepPlan(0, (new("a", [1], [0]), new("a", [1], [1]))), "new request 'a' is already known"),
    ],
)
def test_bad_plans_are_rejected(runner, plan, message):
    runner.reset()
    with pytest.raises(PlanError, match=message):
        runner.execute(plan)
    assert not runner.requests, "a rejected plan must not register anything"


def test_decode_past_block_table_and_bad_placeholder(runner):
    runner.reset()
    runner.execute(StepPlan(0, (new("a", range(4), [0]),)))  # fills block 0 exactly, samples token 5
    with pytest.raises(PlanError, match="'a': block table of 1 blocks .* too short for 5 tokens"):
        runner.execute(StepPlan(1, running=(RunningRequest("a", (), 1),)))
    runner.execute(StepPlan(1, running=(RunningRequest("a", (1,), 1, input_is_placeholder=True),)))
    runner.execute(StepPlan(2, (new("b", range(3), [2]),)))  # 'a' did not sample in step 2
    with pytest.raises(PlanError, match="'a': placeholder input needs"):
        runner.execute(StepPlan(3, running=(RunningRequest("a", (), 1, input_is_placeholder=True),)))
