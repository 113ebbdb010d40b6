"""Sliding-window attention against Hugging Face: prompts and generations well past the window,
prompt chunks smaller and larger than it, decodes, both attention backends, a prefix-cache hit.

The windowed test checkpoints (`testing/checkpoints.py`): mistral (every layer windowed, 16),
gemma2 (window 16 on alternate layers, soft-capped scores) and gemma3_text (window 12 on
alternate layers, their own rope base).
"""

from __future__ import annotations

import pytest
import torch

from stepahead.plan import NewRequest, StepPlan
from testing.checkpoints import VARIANTS, build_checkpoint
from tests.model.driver import GREEDY, generate_staggered
from tests.model.oracle import check_against_hf, oracle_case
from worker_service.attention import AttentionMetadata, TorchAttentionBackend
from worker_service.model_config import ModelConfig
from worker_service.model_runner import ModelRunner
from worker_service.paged_attention import CpuDecodeBackend, PagedDecodeBackend

WINDOWED = ("mistral_untied_gqa1", "gemma2_tied_gqa2", "gemma3_text_untied_gqa2")
PROMPT_LENS = [3, 45, 17, 70, 12, 33]
MAX_NEW = 40  # every request ends well past its window


@pytest.fixture(scope="module", params=WINDOWED)
def windowed(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, prompts, expected = oracle_case(path, request.param, seed=3, prompt_seed=7, lens=PROMPT_LENS, max_new=MAX_NEW)
    return request.param, path, hf, prompts, expected


@pytest.mark.parametrize("backend", [TorchAttentionBackend, PagedDecodeBackend, CpuDecodeBackend],
                         ids=["torch", "paged", "cpu"])
@pytest.mark.parametrize("chunk", [5, 32], ids=["chunk-below-window", "chunk-above-window"])
def test_generations_past_the_window_match_hf(windowed, chunk, backend):
    name, path, _, prompts, expected = windowed
    window = ModelConfig.from_dir(path).sliding_window
    assert 5 < window < 32 and max(PROMPT_LENS) + MAX_NEW > 4 * window  # the chunks: below and above it
    runner = ModelRunner(path, num_blocks=64, block_size=8, attention_backend=backend())
    sched = generate_staggered(runner, prompts, MAX_NEW, chunk=chunk)
    assert sched.stats.mixed_steps > 0
    full = check_against_hf(sched, prompts, expected)
    assert full >= len(prompts) - 1, f"{name}: only {full} streams fully matched"


def test_the_window_changes_the_output(windowed, tmp_path):
    """The oracle itself depends on the window here: without it HF's logits differ (so the tests
    above would fail if attention ignored it)."""
    name, path, hf, prompts, _ = windowed
    model_type, overrides = VARIANTS[name]
    unwindowed = build_checkpoint(tmp_path, model_type, seed=3, **{**overrides, "sliding_window": 4096})
    ids = torch.tensor([prompts[3]])  # 70 tokens
    with torch.no_grad():
        assert not torch.allclose(hf(ids).logits[0, -1], unwindowed(ids).logits[0, -1], atol=1e-3)


def test_a_prefix_cache_hit_past_the_window_matches_hf(windowed):
    """Request b starts with a's first 48 tokens (6 blocks, past the window), which it does not
    compute: its new request reuses a's blocks with num_computed_tokens = 48."""
    _, path, hf, prompts, _ = windowed
    runner = ModelRunner(path, num_blocks=32, block_size=8)
    a = prompts[3][:60]
    b = a[:48] + prompts[1][:20]
    runner.execute(StepPlan(0, (NewRequest("a", tuple(a), GREEDY, tuple(range(8)), 0, len(a)),)))
    blocks = tuple(range(6)) + (20, 21, 22)
    runner.execute(StepPlan(1, (NewRequest("b", tuple(b), GREEDY, blocks, 48, len(b) - 48),)))
    with torch.no_grad():
        expected = hf(torch.tensor([b])).logits[0, -1]
    torch.testing.assert_close(runner.logits_of("b"), expected, rtol=1e-4, atol=1e-4)


def test_a_window_leaves_the_context_unclamped(windowed):
    _, path, _, _, _ = windowed
    cfg = ModelConfig.from_dir(path)
    assert cfg.sliding_window is not None
    assert ModelRunner(path, num_blocks=4).max_model_len == cfg.max_position_embeddings


# -- the backends against a naive reference ---------------------------------------------------

BLOCK = 4


def _reference(q, k_all, v_all, q_pos, scale, window, softcap, sinks=None):
    """Per query, per head, in float64: softmax over the keys p - window < k <= p; with `sinks`
    ([heads] logits, gpt-oss style) exp(l_k) / (sum_k exp(l_k) + exp(sink_h)) instead."""
    out = torch.empty_like(q)  # [n, heads, d]
    group = q.shape[1] // k_all.shape[1]
    for t, p in enumerate(q_pos):
        lo = 0 if window is None else max(0, p - window + 1)
        k, v = k_all[lo : p + 1].double(), v_all[lo : p + 1].double()  # [keys, kvh, d]
        for h in range(q.shape[1]):
            s = k[:, h // group] @ q[t, h].double() * scale  # [keys]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            if sinks is None:
                weights = torch.softmax(s, dim=0)
            else:
                e = torch.exp(s)
                weights = e / (e.sum() + torch.exp(sinks[h].double()))
            out[t, h] = (weights @ v[:, h // group]).float()
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (5, 2.0), (None, 2.0), (64, None)])
@pytest.mark.parametrize("backend", [TorchAttentionBackend, PagedDecodeBackend, CpuDecodeBackend],
                         ids=["torch", "paged", "cpu"])
def test_backends_window_and_softcap_match_a_reference(window, softcap, backend):
    """One sequence of 23 tokens in the cache; a step of 3 decodes (at 22 and at two shorter
    lengths) then one 6-token chunk (positions 17..22), each against the reference."""
    gen = torch.Generator().manual_seed(5)
    heads, kvh, d, n = 4, 2, 8, 23
    k_all, v_all = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
    k_cache, v_cache = torch.zeros(16, BLOCK, kvh, d), torch.zeros(16, BLOCK, kvh, d)
    k_cache.view(-1, kvh, d)[:n], v_cache.view(-1, kvh, d)[:n] = k_all, v_all  # blocks 0..5 in order
    lens = [23, 9, 14]
    q = torch.randn(len(lens) + 6, heads, d, generator=gen)
    tables = torch.arange(6).repeat(len(lens) + 1, 1)  # [reqs, 6]: all share the blocks
    chunk_pos = torch.arange(17, 23)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens) + 6, dtype=torch.int64),
        positions=torch.cat((torch.tensor(lens) - 1, chunk_pos)), block_tables=tables,
        seq_lens=torch.tensor(lens + [23]), num_decodes=len(lens), max_decode_kv=max(lens), decode_uniform=False,
        prefill_token_index=torch.arange(len(lens), len(lens) + 6)[None], prefill_rows=torch.arange(6),
        max_prefill_kv=23)
    out = backend().attend(q, k_cache, v_cache, meta, 0.3, window, softcap)
    expected = _reference(q, k_all, v_all, meta.positions.tolist(), 0.3, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
