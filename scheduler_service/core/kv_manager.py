"""Glue between requests and the device / host block pools: prefix hits, slot allocation,
registration of computed blocks, swap out / in, the sliding window's frees, and the prefix
cache's host tier. No policy decisions here.

Host tier (`host_tier`, --kv-offloading-size): the host pool caches too. A cached device
block that allocation evicts is copied to a host block (a `swap_out` pair of the plan being
built: the worker copies before the step computes, so before the block's new owner writes
it), keeping its content identity; a prefix hit that runs past the device's cached blocks
goes on in the host pool, and those blocks are copied into the request's fresh device blocks
(`swap_in` pairs, before the step computes) instead of being computed again. The host pool is
shared with swapping: its cached blocks are free, evicted LRU when a swap or an offload
needs room."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.block_pool import BlockHashFn, BlockPool, PidSource, default_block_hash
from scheduler_service.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefixHit:
    block_ids: tuple[int, ...]  # cached device blocks, from the first block on
    pids: tuple[int, ...]
    num_free_hits: int  # hit blocks now in the free queue: taking them shrinks it
    host_block_ids: tuple[int, ...] = ()  # the host tier's blocks that continue the hit, to load
    host_pids: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Blocks whose KV the request need not compute: on the device, or loaded from the host."""
        return len(self.block_ids) + len(self.host_block_ids)

    @property
    def num_device_blocks(self) -> int:
        return len(self.block_ids)


NO_HIT = PrefixHit((), (), 0)


class KVCacheManager:
    def __init__(
        self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, enable_caching: bool,
        hash_fn: BlockHashFn = default_block_hash, sliding_window: int = 0, host_tier: bool = False,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's window (0: some layer reads every key)
        self.host_tier = host_tier and enable_caching and num_cpu_blocks > 0
        pids = PidSource()  # one identity per content, in either pool
        self.device = BlockPool(num_gpu_blocks, enable_caching, pids, keep_evicted=self.host_tier)
        self.host = BlockPool(num_cpu_blocks, self.host_tier, pids)
        self.enable_caching = enable_caching
        self._hash_fn = hash_fn

    # ---- prefix cache --------------------------------------------------------------------
    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        """Chained hashes of the request's first `num_blocks` full committed blocks."""
        bs, hashes = self.block_size, request.block_hashes
        assert num_blocks * bs <= request.num_tokens
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = request.token_ids_range(i * bs, (i + 1) * bs)
            hashes.append(self._hash_fn(hashes[-1] if hashes else None, tokens, request.cache_salt))

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Longest verified cached prefix of full blocks (on the device, going on in the host tier),
        leaving >= 1 token to compute."""
        if not self.enable_caching or request.needs_prompt_logprobs:
            return NO_HIT
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        self._extend_hashes(request, max_blocks)
        block_ids, pids = self._cached_chain(self.device, request, 0, max_blocks, 0)
        revive = sum(map(self.device.is_free, block_ids))
        host_ids, host_pids = self._cached_chain(self.host, request, len(block_ids), max_blocks if self.host_tier else 0,
                                                 pids[-1] if pids else 0)
        return PrefixHit(tuple(block_ids), tuple(pids), revive, tuple(host_ids), tuple(host_pids))

    def _cached_chain(self, pool: BlockPool, request: Request, start: int, stop: int,
                      parent: int) -> tuple[list[int], list[int]]:
        """The blocks of `pool` caching the request's blocks `start`, `start + 1`, ... (before
        `stop`) while each continues the chain (`parent`: block `start - 1`'s identity, 0 for
        none), with their identities."""
        bs, block_ids, pids = self.block_size, [], []
        for i in range(start, stop):
            tokens = request.token_ids_range(i * bs, (i + 1) * bs)
            block_id = pool.lookup(request.block_hashes[i], tokens, request.cache_salt, parent)
            if block_id is None:
                break
            parent = pool.pid_of(block_id)
            block_ids.append(block_id)
            pids.append(parent)
        return block_ids, pids

    def take_hit(self, request: Request, hit: PrefixHit) -> None:
        assert not request.block_ids
        for block_id in hit.block_ids:
            self.device.touch(block_id)
        request.block_ids = list(hit.block_ids)
        request.prefix_ids = list(hit.pids)

    def load_host_hit(self, request: Request, hit: PrefixHit, step_id: int) -> list[tuple[int, int]]:
        """(host block, device block) copies of the hit's host part into the device blocks that
        follow its device part (allocated since `take_hit`); each device block is cached with
        the content's identity. The host blocks stay fenced until `step_id` (the copying plan)."""
        if not hit.host_block_ids:
            return []
        first = hit.num_device_blocks
        pairs = list(zip(hit.host_block_ids, request.block_ids[first:first + len(hit.host_block_ids)]))
        for (host_block, device_block), pid in zip(pairs, hit.host_pids):
            entry = self.host.entry_of(host_block)
            request.prefix_ids.append(self.device.register(device_block, entry.hash_value, entry.tokens, entry.salt,
                                                           entry.parent_pid, pid=pid))
            self.host.touch(host_block)
        self.host.free(hit.host_block_ids, step_id)
        return pairs

    def take_offloads(self, step_id: int) -> list[tuple[int, int]]:
        """(device block, host block) copies of the cached device blocks evicted while building
        plan `step_id` (they are someone else's from this step on; the plan copies them first)
        into the host tier, which keeps their identities; LRU host blocks make room. A content
        the host tier holds already is not copied again."""
        pairs = []
        for device_block, entry in self.device.take_evicted():
            if self.host.lookup(entry.hash_value, entry.tokens, entry.salt, entry.parent_pid) is not None:
                continue
            host_blocks = self.host.allocate(1)
            if host_blocks is None:  # every host block holds a swapped request or a copy in flight
                continue
            self.host.register(host_blocks[0], entry.hash_value, entry.tokens, entry.salt, entry.parent_pid,
                               pid=entry.pid)
            self.host.free(host_blocks, step_id)
            # the copy reads the device block in this plan: fenced until it ran, like any block a
            # plan touches (its owner, if the allocation was not undone, holds it anyway)
            self.device.touch(device_block)
            self.device.free((device_block,), step_id)
            pairs.append((device_block, host_blocks[0]))
        return pairs

    def register_computed(self, request: Request) -> None:
        """Cache every full block that is computed and committed (at most one new block per
        decode step: lean on that path). A chain of cached blocks cannot pass a hole the sliding
        window left (a request swapped in after its window passed blocks): nothing after it is cached."""
        if not self.enable_caching or len(request.prefix_ids) < request.num_slid_blocks:
            return
        bs, prefix, hashes, salt = self.block_size, request.prefix_ids, request.block_hashes, request.cache_salt
        for i in range(len(prefix), request.num_committed_tokens // bs):
            tokens = request.token_ids_range(i * bs, (i + 1) * bs)
            if i == len(hashes):  # hashes run from block 0 on, at least as far as the cached prefix
                hashes.append(self._hash_fn(hashes[-1] if hashes else None, tokens, salt))
            parent = prefix[-1] if prefix else 0
            known = self.host.lookup(hashes[i], tokens, salt, parent) if self.host_tier else None
            pid = None if known is None else self.host.pid_of(known)  # the host tier's identity for it
            prefix.append(self.device.register(request.block_ids[i], hashes[i], tokens, salt, parent, pid))

    # ---- slots ---------------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids))

    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens; False if short."""
        need = self.blocks_needed(request, num_tokens)
        if need == 0:
            return True
        blocks = self.device.allocate(need)
        if blocks is None:
            return False
        request.extend_blocks(blocks)
        return True

    def append_blocks(self, requests: list[Request]) -> None:
        """One new block at the end of each request's table (decodes whose blocks are full),
        the same blocks `allocate_slots` would give them one by one, in order; the caller made
        sure the pool has them."""
        if not requests:
            return
        blocks = self.device.allocate(len(requests))
        assert blocks is not None, "append_blocks: the pool is short"
        for request, block in zip(requests, blocks):
            request.extend_blocks((block,))

    def release_slid(self, request: Request) -> int:
        """Give back the request's leading blocks that every layer's sliding window has passed;
        returns how many. No query of the request sits before its last committed token (a
        rejected draft rolls back no further), so no later step reads a key before
        `num_committed_tokens - window`; the blocks wholly before it are freed, fenced while
        its newest plan is in flight. With prefix caching only blocks already cached go while
        its chain of cached blocks is whole (`register_computed`): the cache keeps them for other
        requests. Their ids stay in `block_ids` as holes: the worker's table keeps them and its
        window masks never read them."""
        start = request.num_slid_blocks
        end = (request.num_committed_tokens - self.sliding_window) // self.block_size
        if self.enable_caching and len(request.prefix_ids) >= start:
            end = min(end, len(request.prefix_ids))
        if not self.sliding_window or end <= start:
            return 0
        self.device.free(reversed(request.block_ids[start:end]), request.last_step_id)
        request.num_slid_blocks = end
        return end - start

    def could_allocate_later(self, num_blocks: int) -> bool:
        """Would `num_blocks` fit once every fence is released?"""
        return num_blocks <= self.device.num_free + self.device.num_fenced

    def free(self, request: Request) -> None:
        """Release device and host blocks (fenced while the request's newest plan is in flight)."""
        # Free the tail first: the LRU queue then evicts a sequence's end before its prefix.
        self.device.free(reversed(request.owned_block_ids), request.last_step_id)
        self.host.free(request.host_block_ids, request.last_step_id)
        request.num_slid_blocks = 0
        request.block_ids = []
        request.host_block_ids = []
        request.prefix_ids = []

    # ---- swap ----------------------------------------------------------------------------
    def swap_out(self, request: Request, step_id: int) -> list[tuple[int, int]] | None:
        """Copy the blocks holding confirmed KV to host blocks; None if the host pool is short.
        The device blocks are released, fenced until `step_id` (the plan doing the copy). Blocks
        the sliding window passed are not copied: they stay holes (`swap_in`)."""
        slid, keep = request.num_slid_blocks, cdiv(request.num_computed_tokens, self.block_size)
        if keep == 0:
            return None
        host_blocks = self.host.allocate(keep - slid)
        if host_blocks is None:
            return None
        pairs = list(zip(request.block_ids[slid:keep], host_blocks))
        request.last_step_id = step_id
        self.device.free(reversed(request.owned_block_ids), step_id)
        request.block_ids = []
        request.prefix_ids = []
        request.host_block_ids = host_blocks
        return pairs

    def swap_in(self, request: Request, step_id: int) -> list[tuple[int, int]] | None:
        """Copy the host blocks back into fresh device blocks; None if the device is short. The
        holes of blocks the sliding window passed take the first block's id (never read)."""
        assert not request.block_ids and request.host_block_ids
        device_blocks = self.device.allocate(len(request.host_block_ids))
        if device_blocks is None:
            return None
        pairs = list(zip(request.host_block_ids, device_blocks))
        request.last_step_id = step_id
        self.host.free(request.host_block_ids, step_id)
        request.host_block_ids = []
        request.block_ids = device_blocks[:1] * request.num_slid_blocks + device_blocks
        return pairs
