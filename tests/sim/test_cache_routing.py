"""Cache-aware routing measured through real daemons: `stepahead serve --device sim` with 3
replicas; 4 groups of requests share a 128-token prefix each (a leader, then 3 followers).
With `--routing-policy cache_aware` every follower lands on the replica that computed its
group's prefix: each follower is served 128 cached tokens, and the per-replica prefix-hit
counters (GetStats `replicas`, `stepahead:prefix_cache_hits_total{replica=...}`) add up to
exactly that. `round_robin` on the same workload hits less (it cannot hit every time:
round robin gives each of the 3 replicas 4 of the 12 followers, one replica holds one
group's prefix of 3 followers only)."""

from __future__ import annotations

import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from stepahead.ports import free_port
from stepahead.plan import SamplingParams
from tests.service.harness import Serve
from stepahead.v1.scheduler_pb2 import GetModelRequest
from testing.processes import wait_replicas
from tests.sim.test_sim_e2e import to_proto

REPLICAS, GROUPS, FOLLOWERS, PREFIX, BLOCK = 3, 4, 3, 128, 16


def group_prompts(vocab: int, seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """(one leader per group, the followers): same 128-token prefix per group, own tails."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, vocab) for _ in range(PREFIX)] for _ in range(GROUPS)]
    tail = lambda: [rng.randrange(5, vocab) for _ in range(5)]  # noqa: E731
    return [p + tail() for p in prefixes], [p + tail() for _ in range(FOLLOWERS) for p in prefixes]


def generate_all(serve, prompts: list[list[int]]) -> list[int]:
    """Every prompt at once; the cached prompt tokens each one was served."""
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def one(prompt):
        msgs = list(serve.gateway.Generate(to_proto(prompt, sampling), timeout=120))
        assert sum(len(m.token_ids) for m in msgs) == 4
        return msgs[-1].usage.cached_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def scrape(port: int, name: str) -> dict[str, float]:
    """{replica label: value} of one labelled counter."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    prefix = f'{name}{{replica="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def run_policy(sim_model_dir, fast_profile, policy: str) -> tuple[list[int], dict[str, int], dict[str, float]]:
    metrics_port = free_port()
    flags = ["--device", "sim", "--sim-profile", str(fast_profile), "--block-size", str(BLOCK),
             "--data-parallel-size", str(REPLICAS), "--routing-policy", policy, "--metrics-port", str(metrics_port)]
    with Serve(sim_model_dir, *flags) as serve:
        wait_replicas(serve.scheduler, REPLICAS)
        leaders, followers = group_prompts(serve.scheduler.GetModel(GetModelRequest(), timeout=10).vocab_size)
        generate_all(serve, leaders)  # each group's prefix now cached on the replica that ran it
        cached = generate_all(serve, followers)
        stats = serve.stats()
        per_replica = {r.worker_id: r.stats.prefix_hit_tokens for r in stats.replicas}
        assert sum(per_replica.values()) == stats.prefix_hit_tokens
        exported = scrape(metrics_port, "stepahead:prefix_cache_hits_total")
    return cached, per_replica, exported


@pytest.fixture(scope="module")
def outcomes(sim_model_dir, fast_profile):
    return {policy: run_policy(sim_model_dir, fast_profile, policy) for policy in ("cache_aware", "round_robin")}


def test_cache_aware_sends_each_group_to_the_replica_with_its_prefix(outcomes):
    cached, per_replica, exported = outcomes["cache_aware"]
    assert cached == [PREFIX] * (GROUPS * FOLLOWERS), "every follower reuses its group's whole prefix"
    assert sum(per_replica.values()) == GROUPS * FOLLOWERS * PREFIX, per_replica
    assert exported == {k: float(v) for k, v in per_replica.items() if v}, "metrics per replica = GetStats"


def test_round_robin_hits_less_on_the_same_workload(outcomes):
    rr_cached, rr_per_replica, rr_exported = outcomes["round_robin"]
    assert len(rr_per_replica) == REPLICAS
    assert sum(rr_cached) < sum(outcomes["cache_aware"][0])
    assert sum(rr_per_replica.values()) < sum(outcomes["cache_aware"][1].values())
    assert sum(rr_exported.values()) == sum(rr_per_replica.values())
