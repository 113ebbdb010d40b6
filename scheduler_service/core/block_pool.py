"""A pool of fixed-size KV blocks: ref counts, an LRU free queue, fences, prefix cache.

Every block is in exactly one state:
- in use: `ref_count > 0` (held by one or more requests);
- fenced: `ref_count == 0` but a plan still in flight touches it; it returns to the free
  queue when the result of step `fence_step` has been processed;
- free: in the free queue (O(1) removal). A free block may still carry a prefix-cache
  entry ("cached"): it is reused by a hit, or evicted (LRU, queue head first) on allocation.

Prefix cache: a block's content identity is (parent identity, its tokens, cache salt).
Lookups go by a chained hash, and every hash hit is verified by comparing the tokens, the
salt and the parent identity (`pid`, never reused), so hash collisions cannot alias. Two pools
(the device's and the host tier) can share one `PidSource`: a content keeps its identity when
it moves between them, so a chain continues across the tiers.

What the cache holds stays out of the garbage collector's walks, because a warm cache is as
large as the pool: the identity lives in the block's own slots (the daemon freezes the blocks
when it builds the pool, `stepahead.heap`), the tokens in a tuple of ints, and the hash map
holds tuples of block ids. The collector stops tracking tuples of ints, but it walks a list
or a named tuple at every full collection for as long as it lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

BlockHashFn = Callable[[int | None, tuple[int, ...], str | None], int]


def default_block_hash(parent_hash: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    """Chained hash of one full block: hash(parent hash, tokens, salt)."""
    return hash((parent_hash, tokens, salt))


class CacheEntry(NamedTuple):
    """A cached block's content identity, as `entry_of` and `take_evicted` give it (the block
    keeps the fields in its own slots)."""

    hash_value: int
    tokens: tuple[int, ...]
    salt: str | None
    parent_pid: int  # 0 = first block of a sequence
    pid: int  # this content's identity, unique for the pool's lifetime


class Block:
    __slots__ = ("block_id", "ref_count", "fence_step", "fenced", "pid", "hash_value", "tokens", "salt",
                 "parent_pid")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.fence_step = -1  # newest step known to touch this block
        self.fenced = False
        self.pid = 0  # the cached content's identity; 0: not cached (the fields below mean nothing)
        self.hash_value, self.tokens, self.salt, self.parent_pid = 0, (), None, 0

    def cache_entry(self) -> CacheEntry | None:
        if not self.pid:
            return None
        return CacheEntry(self.hash_value, self.tokens, self.salt, self.parent_pid, self.pid)


class PidSource:
    """Content identities, never reused (one per scheduler core, shared by its pools)."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 1

    def take(self) -> int:
        pid, self.next = self.next, self.next + 1
        return pid


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False, pids: PidSource | None = None,
                 keep_evicted: bool = False) -> None:
        """`keep_evicted`: remember each cached block `allocate` evicts (`take_evicted`)."""
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._fenced: dict[int, list[int]] = {}  # step id -> blocks waiting for that result
        self._num_fenced = 0
        self._done_step = -1  # newest step whose result has been processed
        self._cache: dict[int, tuple[int, ...]] = {}  # hash -> block ids carrying that hash (nearly always one)
        self._num_cached = 0
        self._pids = pids or PidSource()
        self._keep_evicted = keep_evicted
        self._evicted: list[tuple[int, CacheEntry]] = []  # (block, the content it held), since `take_evicted`
        self._num_evictions = 0  # cached blocks whose content allocation dropped, since `take_num_evictions`

    # ---- counts ----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Allocatable now: free, including cached-and-evictable."""
        return len(self._free)

    @property
    def num_fenced(self) -> int:
        return self._num_fenced

    @property
    def num_cached(self) -> int:
        """Blocks carrying a prefix-cache entry (in use or not)."""
        return self._num_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - self._num_fenced

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # ---- allocation --------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref 1), evicting LRU cached ones; None if fewer than n are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.pid:
                self._num_evictions += 1
                if self._keep_evicted:
                    self._evicted.append((block_id, block.cache_entry()))
            self._evict(block)
            block.ref_count = 1
            out.append(block_id)
        return out

    def touch(self, block_id: int) -> None:
        """Take one more reference (a prefix hit); revives free or fenced blocks."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            if block.fenced:
                block.fenced = False
                self._num_fenced -= 1
            else:
                del self._free[block_id]
        block.ref_count += 1

    def free(self, block_ids: Iterable[int], touch_step: int) -> None:
        """Drop one reference each; `touch_step` is the newest plan that touched them via the
        releasing owner. Blocks reaching 0 are fenced while that plan is in flight."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if touch_step > block.fence_step:
                block.fence_step = touch_step
            if block.ref_count:
                continue
            if block.fence_step > self._done_step:
                block.fenced = True
                self._num_fenced += 1
                self._fenced.setdefault(block.fence_step, []).append(block_id)
            else:
                self._free[block_id] = None

    def release_fences(self, step_id: int) -> None:
        """The result of `step_id` has been processed: blocks fenced by it become free."""
        assert step_id > self._done_step, f"step {step_id} released after {self._done_step}"
        self._done_step = step_id
        for block_id in self._fenced.pop(step_id, ()):
            block = self._blocks[block_id]
            if block.ref_count == 0 and block.fenced and block.fence_step <= step_id:
                block.fenced = False
                self._num_fenced -= 1
                self._free[block_id] = None

    # ---- prefix cache ------------------------------------------------------------------
    def lookup(self, hash_value: int, tokens: tuple[int, ...], salt: str | None, parent_pid: int) -> int | None:
        """The block caching exactly this content, verified token by token; else None."""
        for block_id in self._cache.get(hash_value, ()):
            block = self._blocks[block_id]
            if block.parent_pid == parent_pid and block.salt == salt and block.tokens == tokens:
                return block_id
        return None

    def pid_of(self, block_id: int) -> int:
        pid = self._blocks[block_id].pid
        assert pid, f"block {block_id} is not cached"
        return pid

    def register(self, block_id: int, hash_value: int, tokens: tuple[int, ...], salt: str | None, parent_pid: int,
                 pid: int | None = None) -> int:
        """Cache a full computed block; returns the content's pid (an existing identical
        block keeps its entry and this one stays uncached). `pid`: the identity the content
        already has in another pool sharing this one's `PidSource` (else a new one)."""
        existing = self.lookup(hash_value, tokens, salt, parent_pid)
        if existing is not None:
            return self._blocks[existing].pid
        block = self._blocks[block_id]
        assert block.ref_count > 0 and not block.pid, f"cannot cache block {block_id}"
        block.hash_value, block.tokens, block.salt, block.parent_pid = hash_value, tokens, salt, parent_pid
        block.pid = self._pids.take() if pid is None else pid
        self._cache[hash_value] = self._cache.get(hash_value, ()) + (block_id,)
        self._num_cached += 1
        return block.pid

    def entry_of(self, block_id: int) -> CacheEntry | None:
        return self._blocks[block_id].cache_entry()

    def take_num_evictions(self) -> int:
        """Cached blocks whose content `allocate` dropped since the last call."""
        n, self._num_evictions = self._num_evictions, 0
        return n

    def take_evicted(self) -> list[tuple[int, CacheEntry]]:
        """The cached blocks `allocate` evicted since the last call, with what they held (their
        content is still there until the plan being built runs)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict(self, block: Block) -> None:
        if not block.pid:
            return
        chain = self._cache.pop(block.hash_value)
        assert block.block_id in chain, f"cached block {block.block_id} missing from its hash's chain"
        if len(chain) > 1:  # a hash collision: the others stay
            self._cache[block.hash_value] = tuple(b for b in chain if b != block.block_id)
        block.pid, block.tokens, block.salt = 0, (), None
        self._num_cached -= 1

    # ---- integrity ---------------------------------------------------------------------
    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """free + fenced + in use == pool; ref counts equal the owners' holdings."""
        used = fenced = 0
        for block in self._blocks:
            want = expected_refs.get(block.block_id, 0)
            if block.ref_count != want:
                raise AssertionError(f"block {block.block_id}: ref {block.ref_count}, owners hold {want}")
            in_free = block.block_id in self._free
            if block.ref_count:
                used += 1
                if in_free or block.fenced:
                    raise AssertionError(f"block {block.block_id} in use but free/fenced")
            elif block.fenced == in_free:
                raise AssertionError(f"block {block.block_id} unowned: fenced={block.fenced} free={in_free}")
            fenced += block.fenced and not block.ref_count
        if fenced != self._num_fenced or used + fenced + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"pool accounting: used {used} + fenced {fenced}/{self._num_fenced} + free {len(self._free)}"
                f" != {self.num_blocks}"
            )
        cached = sum(len(chain) for chain in self._cache.values())
        if cached != self._num_cached or any(not self._blocks[b].pid for c in self._cache.values() for b in c):
            raise AssertionError(f"prefix cache map holds {cached} blocks, counter says {self._num_cached}")
