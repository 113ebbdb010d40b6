"""The CUDA path of the runner (skipped without a CUDA device).

Greedy tokens on CUDA equal the CPU path's, including when steps are launched back to
back (placeholder decodes read the previous step's ids on the device while its D2H copy
is still in flight).
"""

from __future__ import annotations

import pytest
import torch

from stepahead.plan import NewRequest, RunningRequest, SamplingParams, StepPlan
from tests.model.checkpoints import build_checkpoint
from worker_service.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda-llama")
    build_checkpoint(path, "llama", seed=5, num_attention_heads=4, num_key_value_heads=2)
    return path


def decode_plans(prompts: list[list[int]], steps: int, placeholder: bool) -> list[StepPlan]:
    """A prefill of every prompt, then `steps` decodes; block ids 4 per request."""
    new = tuple(NewRequest(f"r{i}", tuple(p), GREEDY, tuple(range(4 * i, 4 * i + 4)), 0, len(p))
                for i, p in enumerate(prompts))
    plans = [StepPlan(0, new_requests=new)]
    for t in range(1, steps + 1):
        running = tuple(RunningRequest(f"r{i}", (), 1, placeholder) for i in range(len(prompts)))
        plans.append(StepPlan(t, running=running))
    return plans


def run(runner: ModelRunner, plans: list[StepPlan], back_to_back: bool) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    if back_to_back:
        pending = [runner.launch(p) for p in plans]  # nothing waits between launches
        results = [p.wait() for p in pending]
    else:
        results = [runner.execute(p) for p in plans]
    for r in results:
        for rid, t in r.sampled_token_ids.items():
            out.setdefault(rid, []).append(t)
    return out


def test_cuda_greedy_equals_cpu_and_back_to_back_launches(model_dir):
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 12, 13, 14]]
    cpu = ModelRunner(model_dir, block_size=8, num_blocks=16)
    want = run(cpu, decode_plans(prompts, 12, placeholder=False), back_to_back=False)
    cuda = ModelRunner(model_dir, device="cuda", block_size=8, num_blocks=16)
    assert run(cuda, decode_plans(prompts, 12, placeholder=True), back_to_back=True) == want
    cuda.reset()
    assert run(cuda, decode_plans(prompts, 12, placeholder=False), back_to_back=False) == want


def test_cuda_kv_cache_uses_a_fraction_of_free_memory(model_dir):
    free, _ = torch.cuda.mem_get_info()
    runner = ModelRunner(model_dir, device="cuda", gpu_memory_utilization=0.05)
    used = runner.kv_cache.device_pool.numel() * runner.kv_cache.device_pool.element_size()
    assert 0 < used <= 0.05 * free
