"""Every model family through all three daemons: `stepahead serve` on a random checkpoint of
the family (transformers' own classes, sized to the tiny tokenizer), greedy tokens equal to
Hugging Face's `generate` with chunked prefill, a prefix-cache hit and preemption, async
and synchronous. Prompts share a 40-token prefix and run past the Gemma and Mistral test
windows (12-16 tokens), so windowed attention is exercised in prefill, chunks and decode.

The default suite runs two cases (a windowed Gemma 3 asynchronously with swap, Mixtral
synchronously with recompute); the rest of the matrix is `slow`. Tensor parallelism through
the daemons is in `test_tensor_parallel.py`.
"""

from __future__ import annotations

import pytest

from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.service.harness import Serve
from tests.service.hf_oracle import HFGreedy
from tests.service.test_e2e import check_against_hf, random_prompts, run_concurrently
from tests.service.test_tensor_parallel import family_checkpoint

FAMILIES = ("gemma2_tied_gqa2", "gemma3_text_untied_gqa2", "mistral_untied_gqa1", "phi3_untied_gqa4",
            "olmo2_untied_gqa4", "gpt2_tied", "qwen3_moe_untied_gqa2", "mixtral_tied_gqa2")
DEFAULT = {("gemma3_text_untied_gqa2", "async", "swap"), ("mixtral_tied_gqa2", "sync", "recompute")}
SMALL_POOL = ("--num-gpu-blocks-override", "24", "--block-size", "8", "--max-num-batched-tokens", "48")
# Mistral windows every layer (16 keys): the scheduler frees the blocks the window passed, which
# leaves the pool room enough that it seldom preempts; its test checks the frees instead (its
# preemptions, by swap, in test_sliding_window_frees_the_blocks_every_layer_passed)
ALL_WINDOWED = {"mistral_untied_gqa1"}
CASES = [pytest.param(name, loop, mode, marks=() if (name, loop, mode) in DEFAULT else pytest.mark.slow)
         for name in FAMILIES for loop, mode in (("async", "swap"), ("sync", "recompute"))]


@pytest.mark.parametrize("name,loop,mode", CASES)
def test_family_matches_hf_through_the_daemons(tiny_model_dir, tiny_tokenizer, tmp_path, name, loop, mode):  # noqa: F811
    model_dir = family_checkpoint(name, tiny_model_dir, tmp_path / name)
    vocab = len(tiny_tokenizer)
    prefix = random_prompts(1, 40, 40, vocab, seed=11)[0]
    prompts = [prefix + tail for tail in random_prompts(6, 5, 45, vocab, seed=12)]
    max_tokens = [24] * len(prompts)
    flags = ("--async-scheduling" if loop == "async" else "--no-async-scheduling", "--preemption-mode", mode)
    with Serve(model_dir, *SMALL_POOL, *flags, capture_stderr=True) as s:
        first = run_concurrently(s.gateway, prompts[:1], max_tokens[:1])  # fills the prefix cache
        rest = run_concurrently(s.gateway, prompts[1:], max_tokens[1:])
        stats = s.stats()
    problems = s.log_problems()  # nothing at warning or above: no step failed
    assert not problems, problems
    if name in ALL_WINDOWED:
        assert stats.num_slid_blocks > 0, "the prompts were meant to run past the window"
    else:
        assert stats.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    assert stats.prefix_hit_tokens > 0, "the shared prefix was meant to hit the cache"
    assert stats.num_free_blocks == stats.num_total_blocks
    check_against_hf(HFGreedy(model_dir), prompts, first + rest, max_tokens)


@pytest.mark.parametrize("num_requests,num_blocks,mode", [(4, 48, "recompute"), (8, 18, "swap")])
def test_sliding_window_frees_the_blocks_every_layer_passed(tiny_model_dir, tiny_tokenizer, tmp_path,  # noqa: F811
                                                            num_requests, num_blocks, mode):
    """Mistral windows every layer (16 keys here), so the scheduler gives a request's leading
    blocks back once the window passed them. Each request runs to 90 tokens, 23 blocks of 4
    without frees: 4 of them would need 92 of a 48-block pool, and fit without a preemption
    (each holds at most about 10 at once); 8 in a pool of 18 still preempt, by swap, and come
    back with holes in their tables. Prompts of 30-40 tokens prefill in chunks of 16, past the
    window. Tokens equal HF's either way."""
    model_dir = family_checkpoint("mistral_untied_gqa1", tiny_model_dir, tmp_path / "mistral")
    prompts = random_prompts(num_requests, 30, 40, len(tiny_tokenizer), seed=21)
    max_tokens = [90 - len(p) for p in prompts]
    flags = ("--num-gpu-blocks-override", str(num_blocks), "--block-size", "4", "--max-num-batched-tokens", "16",
             "--preemption-mode", mode)
    with Serve(model_dir, *flags, capture_stderr=True) as s:
        outputs = run_concurrently(s.gateway, prompts, max_tokens)
        stats = s.stats()
    problems = s.log_problems()
    assert not problems, problems
    assert stats.num_slid_blocks > 0
    if num_requests == 4:
        assert stats.num_preemptions == 0, "the window's frees were meant to make room for all four"
    else:
        assert stats.num_preemptions > 0, "eight were meant to preempt (by swap) even with the frees"
    assert stats.num_free_blocks == stats.num_total_blocks
    check_against_hf(HFGreedy(model_dir), prompts, outputs, max_tokens)
