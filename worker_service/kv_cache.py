"""The paged KV cache on the device plus a host (CPU) pool for swapping.

One tensor per pool: `[layers, 2 (K/V), blocks, block_size, kv_heads, head_dim]`, so a swap of
a set of blocks is one indexed copy for all layers. Per-layer K and V are views of it.
"""

from __future__ import annotations

import torch

from worker_service.model_config import ModelConfig

DEFAULT_CPU_KV_BYTES = 512 * 1024**2


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def plan_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, *,
                    kv_cache_bytes: int | None, gpu_memory_utilization: float, num_blocks: int | None) -> int:
    """Device blocks from an explicit count, a byte budget, or (CUDA) a fraction of free memory."""
    if num_blocks is not None:
        count = num_blocks
    else:
        if kv_cache_bytes is None:
            if device.type == "cuda":
                if not 0.0 < gpu_memory_utilization <= 1.0:
                    raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
                free, _ = torch.cuda.mem_get_info(device)
                kv_cache_bytes = int(free * gpu_memory_utilization)
            else:
                kv_cache_bytes = DEFAULT_CPU_KV_BYTES
        count = kv_cache_bytes // block_bytes(cfg, block_size, dtype)
    if count < 1:
        raise ValueError(f"KV cache budget leaves {count} blocks; need at least 1")
    return int(count)


class KVCache:
    def __init__(self, cfg: ModelConfig, *, num_blocks: int, num_host_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.num_blocks, self.num_host_blocks, self.block_size = num_blocks, num_host_blocks, block_size
        shape = (cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        # zeros: gathered-but-masked slots must hold finite values (0 * NaN would poison SDPA)
        self.device_pool = torch.zeros(shape[:2] + (num_blocks,) + shape[2:], dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.host_pool = torch.zeros(shape[:2] + (num_host_blocks,) + shape[2:], dtype=dtype, pin_memory=pin)
        self.layers = [(self.device_pool[i, 0], self.device_pool[i, 1]) for i in range(cfg.num_layers)]

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """(device block, host block) copies."""
        if pairs:
            src, dst = self._indices(pairs, self.num_blocks, self.num_host_blocks, "swap_out")
            self.host_pool[:, :, dst] = self.device_pool[:, :, src.to(self.device_pool.device)].cpu()

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """(host block, device block) copies."""
        if pairs:
            src, dst = self._indices(pairs, self.num_host_blocks, self.num_blocks, "swap_in")
            blocks = self.host_pool[:, :, src].to(self.device_pool.device, non_blocking=True)
            self.device_pool[:, :, dst.to(self.device_pool.device)] = blocks

    @staticmethod
    def _indices(pairs, src_limit: int, dst_limit: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        if len(pairs) and (int(src.min()) < 0 or int(src.max()) >= src_limit):
            raise ValueError(f"{what}: source block out of range [0, {src_limit}): {pairs}")
        if len(pairs) and (int(dst.min()) < 0 or int(dst.max()) >= dst_limit):
            raise ValueError(f"{what}: destination block out of range [0, {dst_limit}): {pairs}")
        return src, dst
