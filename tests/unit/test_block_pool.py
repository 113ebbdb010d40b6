"""Block pool and KV manager: ref counts, LRU free queue, fences, prefix cache (with forced
hash collisions), host pool accounting."""

from __future__ import annotations

import pytest

from scheduler_service.core.block_pool import BlockPool
from scheduler_service.core.kv_manager import KVCacheManager
from scheduler_service.core.request import Request
from stepahead.plan import SamplingParams


def make_request(rid: str, prompt, salt=None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), cache_salt=salt)


def test_allocate_free_and_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    assert pool.allocate(2) is None  # all-or-nothing
    pool.touch(1)
    pool.free(a, touch_step=-1)
    assert pool.ref_count(1) == 1 and pool.num_free == 3
    pool.check_integrity({1: 1})
    with pytest.raises(AssertionError, match="double free"):
        pool.free([0], touch_step=-1)


def test_free_queue_is_lru_and_touch_removes_in_the_middle():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]], touch_step=-1)
    pool.touch(0)  # O(1) removal from the middle of the queue
    assert pool.allocate(3) == [2, 3, 1]


def test_fenced_blocks_return_only_after_their_step():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.free(blocks[:2], touch_step=5)  # step 5 is in flight
    assert pool.num_fenced == 2 and pool.num_free == 0
    assert pool.allocate(1) is None
    pool.check_integrity({blocks[2]: 1})
    for step in range(5):
        pool.release_fences(step)
    assert pool.num_fenced == 2
    pool.release_fences(5)
    assert pool.num_fenced == 0 and pool.num_free == 2
    pool.check_integrity({blocks[2]: 1})


def test_fence_keeps_newest_touch_of_any_owner():
    pool = BlockPool(1)
    [b] = pool.allocate(1)
    pool.touch(b)  # shared by two requests
    pool.free([b], touch_step=7)  # first owner last touched it in step 7
    pool.free([b], touch_step=3)  # second owner in step 3: the block is still fenced by 7
    for step in range(7):
        pool.release_fences(step)
        assert pool.num_free == 0
    pool.release_fences(7)
    assert pool.num_free == 1


def test_touching_a_fenced_cached_block_revives_it():
    pool = BlockPool(2, enable_caching=True)
    [b] = pool.allocate(1)
    pool.register(b, 11, (1, 2), None, 0)
    pool.free([b], touch_step=2)
    assert pool.lookup(11, (1, 2), None, 0) == b
    pool.touch(b)  # a prefix hit on a fenced block: reading is safe
    assert pool.num_fenced == 0 and pool.ref_count(b) == 1
    pool.release_fences(0), pool.release_fences(1), pool.release_fences(2)
    assert pool.num_free == 1  # the stale fence entry did not free the block in use
    pool.check_integrity({b: 1})


def test_eviction_drops_the_cache_entry():
    pool = BlockPool(1, enable_caching=True)
    [b] = pool.allocate(1)
    pool.register(b, 11, (1, 2), None, 0)
    pool.free([b], touch_step=-1)
    assert pool.num_cached == 1
    assert pool.allocate(1) == [b]
    assert pool.num_cached == 0 and pool.lookup(11, (1, 2), None, 0) is None


def test_integrity_detects_a_wrong_ref_count():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="ref 1, owners hold 0"):
        pool.check_integrity({})


def _compute_all(kv: KVCacheManager, req: Request) -> None:
    """Pretend the request's prompt was computed and cache its full blocks."""
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_scheduled_tokens = req.num_tokens
    kv.register_computed(req)


@pytest.mark.parametrize("hash_fn", [None, lambda parent, tokens, salt: 42], ids=["real-hash", "all-collide"])
def test_prefix_hits_are_verified_token_by_token(hash_fn):
    kwargs = {"hash_fn": hash_fn} if hash_fn else {}
    kv = KVCacheManager(block_size=2, num_gpu_blocks=16, num_cpu_blocks=0, enable_caching=True, **kwargs)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    _compute_all(kv, first)
    assert len(first.prefix_ids) == 3
    same = kv.find_prefix_hit(make_request("b", [1, 2, 3, 4, 5, 6, 9]))
    assert same.block_ids == tuple(first.block_ids[:3])
    # Same second block tokens (3, 4) but a different first block: the chain must not match.
    other_parent = kv.find_prefix_hit(make_request("c", [9, 9, 3, 4, 5, 6, 1]))
    assert other_parent.num_blocks == 0
    diverging = kv.find_prefix_hit(make_request("d", [1, 2, 3, 8, 5, 6, 1]))
    assert diverging.block_ids == (first.block_ids[0],)
    salted = kv.find_prefix_hit(make_request("e", [1, 2, 3, 4, 5, 6, 9], salt="other-tenant"))
    assert salted.num_blocks == 0


def test_prefix_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=0, enable_caching=True)
    _compute_all(kv, make_request("a", [1, 2, 3, 4]))
    hit = kv.find_prefix_hit(make_request("b", [1, 2, 3, 4]))
    assert hit.num_blocks == 1  # block (3, 4) is cached but its last token must be recomputed


def test_parent_evicted_and_reused_does_not_revive_stale_children():
    kv = KVCacheManager(block_size=2, num_gpu_blocks=2, num_cpu_blocks=0, enable_caching=True,
                        hash_fn=lambda parent, tokens, salt: 0)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.register_computed(a)
    parent, child = a.block_ids
    kv.free(a)
    kv.device.touch(child)  # keep the child cached and in use; evict only the parent
    assert kv.device.allocate(1) == [parent] and kv.device.num_cached == 1
    b = make_request("b", [7, 7, 3, 4, 5])
    b.block_ids, b.num_computed_tokens = [parent], 2
    kv.register_computed(b)  # the parent's block id now caches (7, 7)
    hit = kv.find_prefix_hit(make_request("c", [7, 7, 3, 4, 9]))
    assert hit.block_ids == (parent,)  # (3, 4) under the old (1, 2) must not match


def test_swap_out_and_in_account_host_blocks():
    kv = KVCacheManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=4, enable_caching=False)
    req = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(req, 5)
    req.num_computed_tokens = 3  # blocks 0-1 hold confirmed KV; block 2 is dropped
    device_blocks = list(req.block_ids)
    pairs = kv.swap_out(req, step_id=0)
    assert [d for d, _ in pairs] == device_blocks[:2] and len(req.host_block_ids) == 2
    assert kv.device.num_fenced == 3 and kv.host.num_used == 2
    kv.device.release_fences(0), kv.host.release_fences(0)
    back = kv.swap_in(req, step_id=1)
    assert [h for h, _ in back] == [h for _, h in pairs] and len(req.block_ids) == 2
    assert kv.host.num_fenced == 2  # read by step 1's swap-in copy
    kv.device.release_fences(1), kv.host.release_fences(1)
    assert kv.host.num_free == 4
    kv.device.check_integrity({b: 1 for b in req.block_ids})
