"""The CPU worker's default KV cache: sized from the host's memory, capped by what the batch
can fill, and allocated without writing every byte at start-up."""

from __future__ import annotations

import os

import pytest
import torch

from worker_service.kv_cache import CPU_KV_MEMORY_FRACTION, block_bytes, cpu_kv_cache_bytes, plan_num_blocks, zeros
from worker_service.model_config import ModelConfig, _cgroup_headroom
from testing.checkpoints import VARIANTS, build_checkpoint

GIB = 2**30


def _cfg(tmp_path_factory) -> ModelConfig:
    model_type, overrides = VARIANTS["llama_tied_gqa4"]
    path = tmp_path_factory.mktemp("kv") / "ckpt"
    build_checkpoint(path, model_type, **overrides)
    return ModelConfig.from_dir(path)


def test_the_default_is_a_share_of_the_memory_left(tmp_path_factory):
    cfg = _cfg(tmp_path_factory)
    budget = cpu_kv_cache_bytes(cfg, 16, torch.float32, available_bytes=8 * GIB, max_num_seqs=10**6,
                                max_model_len=10**6)
    assert budget == int(8 * GIB * CPU_KV_MEMORY_FRACTION)
    halved = cpu_kv_cache_bytes(cfg, 16, torch.float32, available_bytes=4 * GIB, max_num_seqs=10**6,
                                max_model_len=10**6)
    assert halved * 2 == budget


def test_the_default_never_exceeds_what_the_batch_can_fill(tmp_path_factory):
    cfg = _cfg(tmp_path_factory)
    per_block = block_bytes(cfg, 16, torch.float32)
    budget = cpu_kv_cache_bytes(cfg, 16, torch.float32, available_bytes=1024 * GIB, max_num_seqs=4,
                                max_model_len=100)
    assert budget == 4 * 7 * per_block  # 4 sequences of ceil(100 / 16) blocks
    assert plan_num_blocks(cfg, 16, torch.float32, kv_cache_bytes=budget, num_blocks=None) == 28
    tiny = cpu_kv_cache_bytes(cfg, 16, torch.float32, available_bytes=0, max_num_seqs=4, max_model_len=100)
    assert tiny == per_block  # one block at least: plan_num_blocks then serves a short request


def test_cpu_pool_is_zero_and_writable():
    pool = zeros((3, 2, 5, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert pool.shape == (3, 2, 5, 16, 2, 8) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    pool[1, 0, 4] = 2.0
    assert pool.sum().item() == 2.0 * 16 * 2 * 8


def _mapping_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps")
def test_cpu_pool_is_private_and_asks_for_huge_pages():
    """A shared anonymous mapping (mmap's default) gets no transparent huge pages where shmem's
    setting is `never` (the usual): the pool must be private to get them."""
    pool = zeros((8, 2, 64, 16, 4, 64), torch.float32, torch.device("cpu"))  # 32 MiB
    pool.fill_(1.0)
    flags = _mapping_flags(pool.data_ptr())
    assert "sh" not in flags, f"the pool is a shared mapping: {sorted(flags)}"
    assert "hg" in flags, f"the pool does not ask for huge pages: {sorted(flags)}"


def test_cgroup_headroom(tmp_path):
    assert _cgroup_headroom(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_headroom(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{8 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{3 * GIB}\n")
    assert _cgroup_headroom(tmp_path) == 5 * GIB
