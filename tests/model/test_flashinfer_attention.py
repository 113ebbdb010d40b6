"""The FlashInfer backend (`worker_service/flashinfer_attention.py`) on CPU, over a stand-in for the
library (`tests/model/flashinfer_standin.py`, FlashInfer's documented semantics in plain torch):
the page metadata it plans from, one plan per step and wrapper, and greedy generations equal to
Hugging Face's through decodes, prompt chunks, sliding windows and soft-capping. What the stand-in
cannot check (the real kernels, their dtypes, the device) the gpu tests do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model import flashinfer_standin
from tests.model.driver import ToyRequest, ToyScheduler, generate_staggered
from tests.model.oracle import check_against_hf, oracle_case
from worker_service.flashinfer_attention import FlashInferBackend, flashinfer_usable, paged_kv
from worker_service.model_runner import ModelRunner

# plain GQA, every layer windowed (mistral), alternate windows + soft-capping (gemma2), alternate
# windows with their own rope base (gemma3)
MODELS = ("llama_tied_gqa4", "mistral_untied_gqa1", "gemma2_tied_gqa2", "gemma3_text_untied_gqa2")
PROMPT_LENS = [3, 45, 17, 70, 12, 33]
MAX_NEW = 40


def test_paged_kv_lists_each_requests_used_blocks_and_its_last_fill():
    tables = np.array([[7, 3, 9, 0], [5, 0, 0, 0], [2, 8, 4, 6]])
    pages = paged_kv(tables, np.array([17, 8, 32]), 8)  # 3 pages (last holds 1), 1 (full), 4 (full)
    assert pages.indptr.tolist() == [0, 3, 4, 8] and pages.indptr.dtype == torch.int32
    assert pages.indices.tolist() == [7, 3, 9, 5, 2, 8, 4, 6] and pages.indices.dtype == torch.int32
    assert pages.last_page_len.tolist() == [1, 8, 8] and pages.last_page_len.dtype == torch.int32


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _, prompts, expected = oracle_case(path, request.param, seed=3, prompt_seed=7, lens=PROMPT_LENS, max_new=MAX_NEW)
    return request.param, path, prompts, expected


@pytest.mark.parametrize("chunk", [5, 32])
def test_generations_match_hf(model, chunk):
    name, path, prompts, expected = model
    backend = FlashInferBackend(torch.device("cpu"), module=flashinfer_standin)
    runner = ModelRunner(path, num_blocks=64, block_size=8, attention_backend=backend)
    sched = generate_staggered(runner, prompts, MAX_NEW, chunk=chunk)
    assert sched.stats.mixed_steps > 0
    full = check_against_hf(sched, prompts, expected)
    assert full >= len(prompts) - 1, f"{name}: only {full} streams fully matched"
    assert {key[0] for key in backend._wrappers} == {"decode", "prefill"}


def test_each_wrapper_is_planned_once_per_step_and_run_by_every_layer(model):
    name, path, prompts, _ = model
    backend = FlashInferBackend(torch.device("cpu"), module=flashinfer_standin)
    runner = ModelRunner(path, num_blocks=64, block_size=8, attention_backend=backend)
    sched = ToyScheduler(runner, chunk=16, token_budget=48, max_running=4)
    for i, p in enumerate(prompts[:3]):
        sched.add(ToyRequest(f"r{i}", p, 6, arrival_step=i))
    steps = 0
    execute = runner.execute

    def count(plan):
        nonlocal steps
        steps += 1
        return execute(plan)

    runner.execute = count
    sched.run()
    layers = runner.model.config.num_layers
    windows = {key[1] for key in backend._wrappers}
    assert len(windows) == (2 if name.startswith("gemma") else 1)  # gemma: windowed and global layers
    for key, wrapper in backend._wrappers.items():
        assert wrapper.plans <= steps, key
        per_plan = layers // len(windows)  # the layers of that window run the plan
        assert wrapper.runs == wrapper.plans * per_plan, (key, wrapper.runs, wrapper.plans)


def test_usable_only_on_cuda_in_half_precision():
    assert "CUDA only" in flashinfer_usable(torch.device("cpu"), torch.float16)
    assert "float16 or bfloat16" in flashinfer_usable(torch.device("cuda"), torch.float32)
