"""Placement of new requests on replicas (`scheduler_service.router`)."""

from __future__ import annotations

import pytest

from scheduler_service.core.request import Request
from scheduler_service.router import Candidate, Router, RouterConfig, RoutingPolicy
from stepahead.plan import SamplingParams

BS = 16
SHARED = list(range(100, 100 + 4 * BS))  # four full blocks


def req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4))


def test_cache_aware_follows_the_longest_routed_prefix():
    router = Router(RouterConfig(RoutingPolicy.CACHE_AWARE), BS)
    loads = {"a": 0, "b": 0, "c": 0}

    def place(r: Request) -> str:
        key = router.choose(r, [Candidate(k, v) for k, v in loads.items()])
        loads[key] += 1
        return key

    first = place(req("p0", SHARED + [1, 2, 3]))
    others = [place(req(f"u{i}", [7 + i] * (2 * BS))) for i in range(2)]  # unrelated: least loaded
    assert first not in others and len(set(others)) == 2
    assert [place(req(f"p{i}", SHARED + [i])) for i in range(1, 6)] == [first] * 5
    assert router.choose(req("half", SHARED[: 2 * BS] + [9] * BS),
                         [Candidate(k, 0) for k in loads]) == first  # a shorter shared prefix still counts


def test_cache_aware_routes_by_load_when_imbalanced_beyond_both_thresholds():
    router = Router(RouterConfig(RoutingPolicy.CACHE_AWARE, balance_abs_threshold=4, balance_rel_threshold=1.5), BS)
    assert router.choose(req("p0", SHARED + [1]), [Candidate("a", 0), Candidate("b", 0)]) == "a"
    # a holds the prefix; within the thresholds it keeps getting it
    assert router.choose(req("p1", SHARED + [2]), [Candidate("a", 5), Candidate("b", 2)]) == "a"  # 5-2 <= 4
    assert router.choose(req("p2", SHARED + [3]), [Candidate("a", 30), Candidate("b", 25)]) == "a"  # 30 <= 1.5*25
    # beyond both: the least loaded one, whatever the prefix
    assert router.choose(req("p3", SHARED + [4]), [Candidate("a", 30), Candidate("b", 10)]) == "b"


def test_a_forgotten_replica_attracts_nothing():
    router = Router(RouterConfig(RoutingPolicy.CACHE_AWARE), BS)
    assert router.choose(req("p0", SHARED + [1]), [Candidate("a", 0), Candidate("b", 0)]) == "a"
    router.forget("a")
    assert router.choose(req("p1", SHARED + [1]), [Candidate("a", 3), Candidate("b", 2)]) == "b"


@pytest.mark.parametrize("policy, want", [
    (RoutingPolicy.ROUND_ROBIN, ["a", "b", "c", "a", "b", "c"]),
    (RoutingPolicy.LEAST_LOADED, ["b"] * 6),
])
def test_round_robin_and_least_loaded(policy, want):
    router = Router(RouterConfig(policy), BS)
    cands = [Candidate("a", 3), Candidate("b", 1), Candidate("c", 2)]
    assert [router.choose(req(f"r{i}", SHARED), cands) for i in range(6)] == want
