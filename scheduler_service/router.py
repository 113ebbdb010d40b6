"""Which replica takes a new request (pure Python; the engine asks, on its own thread).

Policies (`--routing-policy`):
- `round_robin`: each replica in turn.
- `least_loaded`: the replica with the fewest unfinished requests (running + waiting).
- `cache_aware` (default, as SGLang's router): the replica whose routed prompts share the
  longest block-aligned prefix with this one, unless the load is imbalanced, i.e.
  `max_load - min_load > balance_abs_threshold` and `max_load > min_load *
  balance_rel_threshold`: then the least loaded one. Ties and misses go to the least loaded.

The prefix index is the router's own record of what it sent where (chained hashes of
each routed prompt's full blocks, LRU-bounded per replica), not the replicas' KV caches:
requests sharing a prefix that arrive together follow each other before the first one
has computed anything, as SGLang's approximate tree does.
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from scheduler_service.core.block_pool import default_block_hash
from scheduler_service.core.request import Request


class RoutingPolicy(str, enum.Enum):
    CACHE_AWARE = "cache_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class RouterConfig:
    policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    prefix_index_blocks: int = 65536  # per replica, LRU


def prompt_block_hashes(request: Request, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (the same chain the KV manager uses)."""
    tokens, hashes, parent = request.prompt_token_ids, [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = default_block_hash(parent, tokens[start : start + block_size], request.cache_salt)
        hashes.append(parent)
    return hashes


class _PrefixIndex:
    def __init__(self, capacity: int) -> None:
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._capacity = capacity

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self._capacity:
            self._blocks.popitem(last=False)


@dataclass(frozen=True)
class Candidate:
    key: Hashable  # the replica
    load: int  # unfinished requests it holds


class Router:
    def __init__(self, config: RouterConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._index: dict[Hashable, _PrefixIndex] = {}
        self._turn = itertools.count()

    def forget(self, key: Hashable) -> None:
        """The replica is gone: its prefix index means nothing any more."""
        self._index.pop(key, None)

    def choose(self, request: Request, candidates: Sequence[Candidate]) -> Hashable:
        """The replica for `request`; records its prompt under that replica (cache_aware)."""
        assert candidates, "no replica to choose from"
        policy = self.config.policy
        if policy is RoutingPolicy.ROUND_ROBIN:
            return candidates[next(self._turn) % len(candidates)].key
        least = min(candidates, key=lambda c: c.load)
        if policy is RoutingPolicy.LEAST_LOADED:
            return least.key
        hashes = prompt_block_hashes(request, self.block_size)
        chosen = least
        if hashes and not self._imbalanced(candidates):
            best = max(candidates, key=lambda c: (self._match(c.key, hashes), -c.load))
            if self._match(best.key, hashes):
                chosen = best
        self._index.setdefault(chosen.key, _PrefixIndex(self.config.prefix_index_blocks)).insert(hashes)
        return chosen.key

    def _match(self, key: Hashable, hashes: Sequence[int]) -> int:
        index = self._index.get(key)
        return index.match(hashes) if index is not None else 0

    def _imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.load for c in candidates]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.config.balance_abs_threshold and hi > lo * self.config.balance_rel_threshold
