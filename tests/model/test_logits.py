"""Logits agree with Hugging Face's forward (float32) for a prefill and later decodes;
sharded checkpoints and reduced precision load and run."""

from __future__ import annotations

import pytest
import torch

from stepahead.plan import NewRequest, RunningRequest, StepPlan
from testing.checkpoints import VARIANTS, VOCAB, build_checkpoint
from tests.model.driver import GREEDY
from worker_service.model_runner import ModelRunner

PROMPT_LEN = 37
NUM_DECODES = 20
RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return path, build_checkpoint(path, model_type, seed=1, **overrides)


def generate_with_logits(runner: ModelRunner, prompt: list[int], num_decodes: int, chunk: int):
    """Prefill `prompt` in chunks, then decode; returns (tokens, logits per sampled step)."""
    blocks = tuple(range(-(-(len(prompt) + num_decodes) // runner.block_size)))
    first = min(chunk, len(prompt))
    plans = [StepPlan(0, new_requests=(NewRequest("a", tuple(prompt), GREEDY, blocks, 0, first),))]
    done, step = first, 1
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        plans.append(StepPlan(step, running=(RunningRequest("a", (), n),)))
        done, step = done + n, step + 1
    tokens, logits = [], []
    for plan in plans:
        result = runner.execute(plan)
    for k in range(num_decodes + 1):
        tokens.append(result.sampled_token_ids["a"])
        logits.append(runner.logits_of("a").clone())
        if k < num_decodes:
            result = runner.execute(StepPlan(step + k, running=(RunningRequest("a", (), 1, k % 2 == 0),)))
    return tokens, torch.stack(logits)  # [num_decodes + 1, vocab]


def hf_logits(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    seq = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        out = hf(seq).logits[0].float()  # [len, vocab]
    return out[len(prompt) - 1:]


@pytest.mark.parametrize("chunk", [PROMPT_LEN, 8])
def test_logits_match_hf_forward(checkpoint, chunk):
    path, hf = checkpoint
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    runner = ModelRunner(path, num_blocks=16, block_size=4)
    tokens, ours = generate_with_logits(runner, prompt, NUM_DECODES, chunk)
    expected = hf_logits(hf, prompt, tokens)
    assert ours.shape == expected.shape == (NUM_DECODES + 1, VOCAB)
    err = (ours - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)  # per position
    assert err.max().item() < RTOL, f"relative logit error per position: {err.tolist()}"


def test_sharded_checkpoint_loads_identically(tmp_path):
    model_type, overrides = VARIANTS["qwen2_untied_gqa4"]
    hf = build_checkpoint(tmp_path / "one", model_type, seed=2, **overrides)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    prompt = list(range(3, 40))
    one = generate_with_logits(ModelRunner(tmp_path / "one", num_blocks=16, block_size=4), prompt, 4, 16)
    sharded = generate_with_logits(ModelRunner(tmp_path / "sharded", num_blocks=16, block_size=4), prompt, 4, 16)
    assert one[0] == sharded[0]
    torch.testing.assert_close(one[1], sharded[1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_tracks_float32(checkpoint, dtype):
    path, _ = checkpoint
    prompt = list(range(1, 30))
    _, ref = generate_with_logits(ModelRunner(path, num_blocks=16, block_size=4), prompt, 3, 16)
    runner = ModelRunner(path, dtype=dtype, num_blocks=16, block_size=4)
    assert runner.kv_cache.device_pool.dtype == runner.dtype == getattr(torch, dtype)
    _, low = generate_with_logits(runner, prompt, 0, 16)
    assert low.dtype == torch.float32
    err = (low[0] - ref[0]).abs().max() / ref[0].abs().max()
    assert err < 0.05, f"{dtype} logits drift {err:.3g} from float32"
