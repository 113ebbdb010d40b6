"""Decode attention of the torch backend and the CPU kernel against a naive per-request reference.

The reference reads each request's keys token by token through its block table and runs
plain softmax attention per query head; the backend must match it whatever the chunking
(CPU decode attends in cache-sized chunks of requests), the GQA group size, and whether
the requests' lengths are uniform (maskless) or not.
"""

from __future__ import annotations

import pytest
import torch

from worker_service import cpu_kernels
from worker_service.attention import AttentionMetadata, TorchAttentionBackend
from worker_service.paged_attention import CpuDecodeBackend

BLOCK = 4


def _decode_meta(seq_lens: list[int], num_blocks: int, gen: torch.Generator, block: int = BLOCK) -> AttentionMetadata:
    """Decode-only metadata with each request's blocks drawn at random from the pool."""
    per_req = [-(-n // block) for n in seq_lens]
    width = max(per_req)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    used = 0
    for i, nb in enumerate(per_req):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    positions = lens - 1
    slots = tables[torch.arange(len(seq_lens)), positions // block] * block + positions % block
    empty = torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(
        slot_mapping=slots, positions=positions, block_tables=tables, seq_lens=lens,
        num_decodes=len(seq_lens), max_decode_kv=max(seq_lens), decode_uniform=len(set(seq_lens)) == 1,
        prefill_token_index=empty.view(0, 0), prefill_rows=empty, max_prefill_kv=0,
    )


def _reference(q, k_cache, v_cache, meta, scale):
    """Per request, per head: softmax(q k^T * scale) v over the request's first seq_len keys."""
    out = torch.empty_like(q)  # [reqs, heads, d]
    group, block = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    for r, n in enumerate(meta.seq_lens.tolist()):
        pos = torch.arange(n)
        slots = meta.block_tables[r, pos // block] * block + pos % block
        k = k_cache.flatten(0, 1)[slots].double()  # [n, kvh, d]
        v = v_cache.flatten(0, 1)[slots].double()
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // group] @ q[r, h].double() * scale, dim=0)  # [n]
            out[r, h] = (w @ v[:, h // group]).float()
    return out


@pytest.mark.parametrize("lens", [[37] * 9, [1, 5, 16, 17, 40, 3, 29, 8, 33]], ids=["uniform", "ragged"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("chunk_reqs", [1, 4, 100], ids=["per-request", "chunks-of-4", "one-chunk"])
def test_decode_matches_reference(lens, heads, kv_heads, chunk_reqs):
    gen = torch.Generator().manual_seed(len(lens) * 100 + heads * 10 + kv_heads)
    d, num_blocks = 16, 128
    meta = _decode_meta(lens, num_blocks, gen)
    chunk_bytes = chunk_reqs * 2 * -(-max(lens) // BLOCK) * BLOCK * kv_heads * d * 4  # K+V, float32
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, d, generator=gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    backend = TorchAttentionBackend(cpu_decode_chunk_bytes=chunk_bytes)
    out = backend.attend(q, k_cache, v_cache, meta, scale=d**-0.5)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, meta, d**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[37] * 9, [1, 5, 16, 17, 40, 3, 29, 8, 33]], ids=["uniform", "ragged"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1), (9, 3)])
@pytest.mark.parametrize("width", [0, 3], ids=["tables-fit", "tables-wider"])
@pytest.mark.parametrize("d,block", [(16, 4), (64, 4), (64, 32), (128, 16), (80, 16)],
                         ids=["d16", "d64", "d64-block32", "d128", "d80"])
@pytest.mark.parametrize("vectorized", [True, False], ids=["vectorized", "portable"])
def test_cpu_kernel_decode_matches_reference(lens, heads, kv_heads, width, d, block, vectorized):
    """The C++ kernel reads the blocks in place; tables wider than a request's blocks (padded
    with block 0, as bucketed tables are) must not change what it reads. On an AVX-512 build
    every dim here takes its AVX-512 loop unless `vectorized=False`; then 64 and 128 take the
    portable loop specialised for that dim, 16 and 80 the generic one. Block sizes 4 to 32 (a
    32-key block is two of the AVX-512 loop's 16-key steps)."""
    gen = torch.Generator().manual_seed(len(lens) * 100 + heads * 10 + kv_heads)
    num_blocks = 128
    meta = _decode_meta(lens, num_blocks, gen, block)
    meta.block_tables = torch.cat((meta.block_tables, torch.zeros(len(lens), width, dtype=torch.int64)), dim=1)
    k_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    if vectorized:
        out = CpuDecodeBackend().attend(q, k_cache, v_cache, meta, scale=d**-0.5)
    else:
        out = cpu_kernels.paged_decode(cpu_kernels.load(), q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       d**-0.5, None, None, None, vectorized=False)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, meta, d**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window,softcap,sinks", [(5, None, False), (None, 20.0, False), (None, None, True),
                                                  (7, 30.0, True)], ids=["window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("vectorized", [True, False], ids=["vectorized", "portable"])
def test_cpu_kernel_window_softcap_sinks_match_the_torch_backend(d, window, softcap, sinks, vectorized):
    """Sliding window (a first block entered part way), soft-capped scores and attention sinks:
    both loops of the kernel equal the torch backend, on ragged lengths over 16-key blocks."""
    gen = torch.Generator().manual_seed(d + (window or 0) + int(sinks))
    lens, kv_heads, heads, num_blocks, block = [1, 5, 16, 17, 40, 3, 29, 8, 33], 2, 6, 64, 16
    meta = _decode_meta(lens, num_blocks, gen, block)
    k_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    sink = torch.randn(heads, generator=gen) if sinks else None
    expected = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, d**-0.5, window, softcap, sinks=sink)
    out = cpu_kernels.paged_decode(cpu_kernels.load(), q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   d**-0.5, window, softcap, sink, vectorized=vectorized)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("vectorized", [True, False], ids=["vectorized", "portable"])
def test_cpu_kernel_over_more_kv_than_the_caches_hold(block, window, vectorized):
    """A call over more K/V than the kernel's prefetch threshold (`PREFETCH_MIN_BYTES`, 4 MiB) takes the
    loops that ask for each pass's rows ahead (into the next block, at most to the last key): the same
    attention, on ragged lengths over scattered blocks, blocks smaller and larger than that distance."""
    gen = torch.Generator().manual_seed(block + (window or 0))
    lens, kv_heads, heads, d = [700, 1, 333, 64, 517, 9, 640, 256], 4, 8, 64
    assert 2 * sum(lens) * kv_heads * d * 4 > 4 << 20
    num_blocks = sum(-(-n // block) for n in lens) + 3
    meta = _decode_meta(lens, num_blocks, gen, block)
    k_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, block, kv_heads, d, generator=gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    expected = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, d**-0.5, window)
    out = cpu_kernels.paged_decode(cpu_kernels.load(), q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                   d**-0.5, window, None, None, vectorized=vectorized)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("strided", [True, False], ids=["qkv-views", "contiguous"])
def test_cpu_kernel_write_kv_equals_the_torch_backend(tokens, strided):
    """The kernel's K/V write puts every token's rows where the torch backend's index_copy_ does,
    from views into a fused projection as from contiguous tensors, and touches nothing else; a slot
    past the cache is refused before anything is written."""
    gen = torch.Generator().manual_seed(tokens)
    kv_heads, d, num_blocks, block = 2, 16, 16, 4
    qkv = torch.randn(tokens, (3 + 2 * kv_heads) * d, generator=gen)
    k = qkv[:, 3 * d:(3 + kv_heads) * d].view(tokens, kv_heads, d)  # row stride: the projection's width
    v = qkv[:, (3 + kv_heads) * d:].view(tokens, kv_heads, d)
    if not strided:
        k, v = k.contiguous(), v.contiguous()
    meta = _decode_meta([1] * tokens, num_blocks, gen, block)
    meta.slot_mapping = torch.randperm(num_blocks * block, generator=gen)[:tokens]
    caches = [torch.randn(num_blocks, block, kv_heads, d, generator=gen) for _ in range(2)]
    expected = [c.clone() for c in caches]
    TorchAttentionBackend().write_kv(k, v, *expected, meta)
    CpuDecodeBackend().write_kv(k, v, *caches, meta)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    before = [c.clone() for c in caches]
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[-1] = num_blocks * block
    with pytest.raises(RuntimeError, match="outside the cache"):
        CpuDecodeBackend().write_kv(k, v, *caches, meta)
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])


@pytest.mark.parametrize("max_len", [3 * BLOCK, 3 * BLOCK - 1], ids=["whole-blocks", "rounded-up"])
def test_chunks_follow_the_byte_budget(max_len):
    """Chunks of 3 requests when 3 requests' K+V fit the budget (lengths round up to blocks)."""
    gen = torch.Generator().manual_seed(1)
    meta = _decode_meta([max_len] * 7, 64, gen)
    k_cache = torch.zeros(64, BLOCK, 2, 16)
    per_req = 2 * 3 * BLOCK * 2 * 16 * 4  # K+V of 3 blocks, float32
    chunks = TorchAttentionBackend(cpu_decode_chunk_bytes=3 * per_req + 1)._build_decode_chunks(
        meta, k_cache, torch.device("cpu"))
    assert [(c.start, c.end) for c in chunks] == [(0, 3), (3, 6), (6, 7)]
    assert torch.equal(chunks[1].blocks, meta.block_tables[3:6, :3].reshape(-1))


def test_chunks_are_rebuilt_for_each_step():
    """Decode chunks are cached per metadata object: a new step's tables must be used."""
    gen = torch.Generator().manual_seed(2)
    d, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, BLOCK, 2, d, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, 2, d, generator=gen)
    backend = TorchAttentionBackend()
    for lens in ([9, 9], [5, 13], [13, 5]):
        meta = _decode_meta(lens, num_blocks, gen)
        q = torch.randn(len(lens), 4, d, generator=gen)
        out = backend.attend(q, k_cache, v_cache, meta, scale=0.25)
        torch.testing.assert_close(out, _reference(q, k_cache, v_cache, meta, 0.25), rtol=1e-5, atol=1e-5)


def test_bad_chunk_budget_is_rejected():
    with pytest.raises(ValueError, match="cpu_decode_chunk_bytes"):
        TorchAttentionBackend(cpu_decode_chunk_bytes=0)
