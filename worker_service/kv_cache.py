"""The paged KV cache on the device plus a host (CPU) pool for swapping.

The device pool is one tensor `[layers, 2 (K/V), blocks + 1, block_size, kv_heads, head_dim]`
(per-layer K and V are views of it; the extra block is the dummy block); the host pool is
block-major, `[host_blocks, layers, 2, block_size, kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch

from worker_service.model_config import ModelConfig
from worker_service.streams import host_to_device

DEFAULT_CPU_KV_BYTES = 512 * 1024**2


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def plan_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, *, kv_cache_bytes: int | None,
                    num_blocks: int | None) -> int:
    """Device blocks from an explicit count, else a byte budget (default: 512 MiB; on CUDA the
    runner passes what its profiling run left, see `memory_profile`)."""
    if num_blocks is not None:
        count = num_blocks
    else:
        budget = DEFAULT_CPU_KV_BYTES if kv_cache_bytes is None else kv_cache_bytes
        count = budget // block_bytes(cfg, block_size, dtype)
    if count < 1:
        raise ValueError(f"KV cache budget leaves {count} blocks; need at least 1")
    return int(count)


class KVCache:
    """`num_blocks` usable device blocks plus one dummy block (id `num_blocks`) that padding rows
    of a bucketed decode batch write to and read from; the scheduler never sees it.

    Swaps run on the caller's current stream (the compute stream), in order with the steps
    around them, and never wait on the host: block indices go up from pinned memory, and the
    host pool is laid out block-major (`[host_blocks, layers, 2, ...]`) so each swapped block
    is one contiguous pinned region, copied with a non-blocking `copy_`.
    """

    def __init__(self, cfg: ModelConfig, *, num_blocks: int, num_host_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks, self.num_host_blocks, self.block_size = num_blocks, num_host_blocks, block_size
        self.dummy_block = num_blocks
        block = (block_size, cfg.num_kv_heads, cfg.head_dim)
        # zeros: gathered-but-masked slots must hold finite values (0 * NaN would poison SDPA)
        self.device_pool = torch.zeros((cfg.num_layers, 2, num_blocks + 1) + block, dtype=dtype, device=device)
        self._pin = device.type == "cuda"
        self.host_pool = torch.zeros((num_host_blocks, cfg.num_layers, 2) + block, dtype=dtype, pin_memory=self._pin)
        self.layers = [(self.device_pool[i, 0], self.device_pool[i, 1]) for i in range(cfg.num_layers)]

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """(device block, host block) copies."""
        if pairs:
            src, dst = self._indices(pairs, self.num_blocks, self.num_host_blocks, "swap_out")
            # [n, layers, 2, block...] contiguous on the device, then one D2H copy per block
            staged = self.device_pool.index_select(2, self._to_device(src)).movedim(2, 0).contiguous()
            for i, h in enumerate(dst.tolist()):
                self.host_pool[h].copy_(staged[i], non_blocking=True)
            # `staged` is freed on this stream: the allocator reuses it only after the copies

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """(host block, device block) copies."""
        if pairs:
            src, dst = self._indices(pairs, self.num_host_blocks, self.num_blocks, "swap_in")
            staged = torch.empty((len(pairs),) + self.host_pool.shape[1:], dtype=self.host_pool.dtype,
                                 device=self.device_pool.device)
            for i, h in enumerate(src.tolist()):
                staged[i].copy_(self.host_pool[h], non_blocking=True)
            self.device_pool.index_copy_(2, self._to_device(dst), staged.movedim(0, 2))

    def _to_device(self, index: torch.Tensor) -> torch.Tensor:
        return host_to_device(index, torch.int64, self.device_pool.device)

    @staticmethod
    def _indices(pairs, src_limit: int, dst_limit: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        if len(pairs) and (int(src.min()) < 0 or int(src.max()) >= src_limit):
            raise ValueError(f"{what}: source block out of range [0, {src_limit}): {pairs}")
        if len(pairs) and (int(dst.min()) < 0 or int(dst.max()) >= dst_limit):
            raise ValueError(f"{what}: destination block out of range [0, {dst_limit}): {pairs}")
        return src, dst
