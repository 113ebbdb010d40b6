"""The compiled forward (`--no-enforce-eager`: torch.compile, paged attention an opaque op)
against Hugging Face: greedy tokens of mixed batches (chunked prefill, joins, leaves) equal
HF `generate` (tie rule: `tests/model/oracle.py`). Compiling is slow on a small CPU, so the
default suite compiles one Llama variant; the other families are `slow`.
"""

from __future__ import annotations

import pytest
import torch

from testing.checkpoints import VARIANTS, build_checkpoint
from tests.model.oracle import check_against_hf, hf_greedy, random_prompts
from tests.model.test_oracle_generate import run_workload
from worker_service.model_runner import ModelRunner

PROMPT_LENS = [1, 40, 7, 16, 17, 33, 2, 64]
DEFAULT = "llama_tied_gqa4"
# GPT-2 (learned positions from ctx.meta), Gemma 2 (window, soft-caps), MoE routing, OLMo 2's norms
SLOW = ("gpt2_tied", "gemma2_tied_gqa2", "qwen3_moe_untied_gqa2", "olmo2_untied_gqa4", "qwen3_tied_gqa1")
# the routing's data-dependent shapes break the graph: new pieces compile as the routes change
DATA_DEPENDENT = {"qwen3_moe_untied_gqa2"}


def _compiled_matches_hf(name: str, tmp_path) -> None:
    model_type, overrides = VARIANTS[name]
    hf = build_checkpoint(tmp_path, model_type, **overrides)
    prompts = random_prompts(11, PROMPT_LENS)
    expected = hf_greedy(hf, prompts, 24)
    torch._dynamo.reset()
    runner = ModelRunner(tmp_path, num_blocks=160, block_size=16, enforce_eager=False)
    assert runner.warm_up_seconds > 0
    assert runner.packed_linears > 0  # compiled around the packed linears' opaque ops
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1, "the warm-up compiled nothing"
    if name == DEFAULT:  # regional: one layer traced, its graphs (one-token steps, the rest) shared by every layer
        assert runner.model.config.num_layers >= 2 and graphs == 2, graphs
    sched = run_workload(runner, prompts, chunk=16, token_budget=48, max_running=6, max_new=24)
    assert sched.stats.mixed_steps > 0 and sched.stats.placeholder_decodes > 0
    if name not in DATA_DEPENDENT:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a step compiled a graph the warm-up did not"
    full = check_against_hf(sched, prompts, expected)
    assert full >= len(prompts) - 1, f"{name}: only {full} streams fully matched"


def test_compiled_forward_matches_hf(tmp_path):
    _compiled_matches_hf(DEFAULT, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_compiled_families_match_hf(name, tmp_path):
    _compiled_matches_hf(name, tmp_path)


def test_worker_flags_default_to_the_cpu_kernel_eagerly(tmp_path, monkeypatch):
    """serve/worker defaults on CPU float32: the C++ decode kernel, no compile; --no-enforce-eager
    asks for the compiled forward, which a tensor-parallel rank refuses."""
    import argparse
    import dataclasses

    from stepahead import config as cfg
    from worker_service.daemon import WorkerConfig, add_arguments
    from worker_service.paged_attention import CpuDecodeBackend
    from worker_service.runners import build_runner, resolve_enforce_eager

    model_type, overrides = VARIANTS[DEFAULT]
    build_checkpoint(tmp_path, model_type, **overrides)
    parser = argparse.ArgumentParser()
    monkeypatch.setenv("STEPAHEAD_MAX_NUM_SEQS", "4")
    add_arguments(parser)
    config = cfg.from_args(WorkerConfig, parser.parse_args(["--model", str(tmp_path), "--num-gpu-blocks-override", "16"]))
    runner, _ = build_runner(config)
    assert isinstance(runner.backend, CpuDecodeBackend) and runner.enforce_eager and runner.warm_up_seconds == 0
    compiled = cfg.from_args(WorkerConfig, parser.parse_args(["--model", str(tmp_path), "--no-enforce-eager"]))
    assert compiled.enforce_eager is False and resolve_enforce_eager(compiled, tensor_parallel=False) is False
    assert resolve_enforce_eager(config, tensor_parallel=True) is True
    with pytest.raises(ValueError, match="tensor-parallel"):
        resolve_enforce_eager(dataclasses.replace(compiled, tensor_parallel_size=2), tensor_parallel=True)
