"""The prefix cache's host tier through the three daemons (`--kv-offloading-size`): blocks the
device pool evicts are copied to host memory and copied back on a prefix hit, and the tokens
stay Hugging Face's."""

from __future__ import annotations

from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.service.harness import Serve
from tests.service.hf_oracle import HFGreedy
from tests.service.test_e2e import check_against_hf, random_prompts, run_concurrently

# 24 blocks of 8 tokens: one conversation's turn fits, the next four requests evict it
POOL = ("--num-gpu-blocks-override", "24", "--block-size", "8", "--max-num-batched-tokens", "64")


def test_evicted_prefix_blocks_come_back_from_host_memory(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    vocab = len(tiny_tokenizer)
    first = random_prompts(1, 64, 64, vocab, seed=31)[0]
    others = random_prompts(4, 60, 70, vocab, seed=32)
    prompts = [first, *others, first + random_prompts(1, 20, 20, vocab, seed=33)[0]]
    max_tokens = [16] * len(prompts)
    with Serve(tiny_model_dir, *POOL, "--kv-offloading-size", "0.05", capture_stderr=True) as s:
        outputs = [run_concurrently(s.gateway, [p], [m])[0] for p, m in zip(prompts, max_tokens)]
        stats = s.stats()
    problems = s.log_problems()
    assert not problems, problems
    assert stats.num_offloaded_blocks > 0, "the other requests were meant to evict the first one's blocks"
    assert stats.prefix_host_hit_tokens >= 8 * 8, "the last turn was meant to load its prefix from the host"
    assert stats.num_free_blocks == stats.num_total_blocks
    check_against_hf(HFGreedy(tiny_model_dir), prompts, outputs, max_tokens)
