"""The paged KV cache on the device plus a host (CPU) pool for swapping.

The device pool is one tensor `[layers, 2 (K/V), blocks + 1, block_size, kv_heads, head_dim]`
(per-layer K and V are views of it; the extra block is the dummy block); the host pool is
block-major, `[host_blocks, layers, 2, block_size, kv_heads, head_dim]`.
"""

from __future__ import annotations

import math
import mmap

import torch

from stepahead.config import ConfigError
from worker_service.model_config import ModelConfig
from worker_service.streams import host_to_device

# On a CPU device without --kv-cache-memory-bytes / --num-gpu-blocks-override: this share of the
# host memory still available once the weights are loaded (each worker of a machine takes its
# share of what the ones before it left), and never more than `max_num_seqs` sequences of
# `max_model_len` tokens could fill.
CPU_KV_MEMORY_FRACTION = 0.25


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def cpu_kv_cache_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, *, available_bytes: int,
                       max_num_seqs: int, max_model_len: int) -> int:
    """The CPU default KV budget: `CPU_KV_MEMORY_FRACTION` of `available_bytes` (the host's,
    measured after loading the weights), capped at what the worker's batch could ever hold."""
    per_block = block_bytes(cfg, block_size, dtype)
    need = max_num_seqs * -(-max_model_len // block_size) * per_block
    return max(min(need, int(available_bytes * CPU_KV_MEMORY_FRACTION)), per_block)


class KVCacheTooSmall(ConfigError):
    """The KV cache budget holds no block: an operator's setting, which the worker exits with
    (a session would meet it again: no re-attach retries it)."""


def plan_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, *, kv_cache_bytes: int | None,
                    num_blocks: int | None) -> int:
    """Device blocks from an explicit count, else a byte budget (the flag's; on CUDA what the
    profiling run left, see `memory_profile`; on CPU `cpu_kv_cache_bytes`)."""
    if num_blocks is not None:
        count = num_blocks
    else:
        per_block = block_bytes(cfg, block_size, dtype)
        count = kv_cache_bytes // per_block
        if count < 1:
            raise KVCacheTooSmall(
                f"a KV cache of {kv_cache_bytes} bytes holds no block of {block_size} tokens ({per_block} bytes "
                "for this model): raise --kv-cache-memory-bytes (on CUDA, --gpu-memory-utilization)")
    if count < 1:
        raise KVCacheTooSmall(f"{count} KV cache blocks; need at least 1 (--num-gpu-blocks-override)")
    return int(count)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, except on the CPU: fresh anonymous pages, which the kernel gives zeroed
    and commits as they are first written, so start-up does not write every byte of a cache
    sized to the host's memory. The mapping is private, and asks for transparent huge pages
    (which the kernel gives a private anonymous mapping in its `madvise` mode, and a shared one,
    `mmap`'s default, only where shmem's own setting allows, usually never): the decode kernel
    walks the cache block by block, and on 4 KiB pages a step's K/V outgrows the TLB's reach
    (`benchmarks/experiments/decode_kernel.py`)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * torch.empty((), dtype=dtype).element_size(), 1),
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # the tensor keeps `pages` alive


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
        self.device_pool = zeros((cfg.num_layers, 2, num_blocks + 1) + block, dtype, device)
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

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block as `read_blocks` lays it out: every layer's K and V."""
        return self.device_pool[:, :, 0].numel() * self.device_pool.element_size()

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The KV of device blocks, block after block, each `[layers, 2 (K/V), block_size,
        kv_heads, head_dim]` in the pool's dtype (the layout `write_blocks` takes back).
        Runs on the caller's current stream and waits for its copy to the host."""
        index = self._to_device(torch.tensor(block_ids, dtype=torch.int64))
        # [layers, 2, n, block...] gathered, then block-major [n, layers, 2, block...] on the host
        staged = self.device_pool.index_select(2, index).movedim(2, 0).contiguous().cpu()
        return staged.view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Device blocks from `read_blocks`' layout (len(block_ids) blocks of `bytes_per_block`),
        on the caller's current stream: the caller synchronises it before the blocks are read."""
        n = len(block_ids)
        if len(data) != n * self.bytes_per_block:
            raise ValueError(f"write_blocks: {len(data)} bytes for {n} blocks of {self.bytes_per_block}")
        block = self.device_pool.shape[:2] + self.device_pool.shape[3:]  # [layers, 2, block_size, heads, dim]
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.device_pool.dtype).view((n,) + block)
        staged = host.to(self.device_pool.device)  # [n, layers, 2, block...]
        self.device_pool.index_copy_(2, self._to_device(torch.tensor(block_ids, dtype=torch.int64)),
                                     staged.movedim(0, 2))

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
