"""The sim worker through all three daemons (`stepahead serve --device sim`): 64 concurrent
requests with preemption (a small pool), shared prefixes and aborts give the reference
tokens in async mode (two and three plans in flight) and sync mode; the worker process never
maps torch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stepahead.plan import SamplingParams
from stepahead.v1 import common_pb2, generation_pb2
from tests.service.harness import Serve
from tests.service.streams import wait_idle
from tests.sim.workload import mixed_workload
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner
from worker_service.sim.tokens import reference_output

SEED, EOS_P, BLOCKS = 11, 0.05, 24


def flags(profile: str, window: int) -> list[str]:
    """`window`: plans in flight at most (1: the synchronous loop)."""
    loop = ["--no-async-scheduling"] if window == 1 else ["--async-scheduling", "--max-concurrent-batches", str(window)]
    return ["--device", "sim", "--sim-profile", profile, "--sim-eos-probability", str(EOS_P),
            "--seed", str(SEED), "--num-gpu-blocks-override", str(BLOCKS), "--block-size", "16",
            *loop, "--max-num-batched-tokens", "512"]


def to_proto(prompt: list[int], s: SamplingParams) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens,
                                         min_tokens=s.min_tokens, stop_token_ids=s.stop_token_ids,
                                         ignore_eos=s.ignore_eos)
    if s.seed is not None:
        sampling.seed = s.seed
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling=sampling)


def collect(stub, request, cancel_after: int | None) -> list[int]:
    tokens: list[int] = []
    call = stub.Generate(request, timeout=120)
    for msg in call:
        tokens += msg.token_ids
        if cancel_after is not None and len(tokens) >= cancel_after:
            call.cancel()
            break
    return tokens


def run_all(serve, work, aborted: set[int]) -> list[list[int]]:
    with ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(collect, serve.gateway, to_proto(p, s), 3 if i in aborted else None)
                   for i, (p, s) in enumerate(work)]
        return [f.result() for f in futures]


def worker_maps(serve) -> str:
    for pid in serve.child_pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"worker" in cmdline:
            return Path(f"/proc/{pid}/maps").read_text()
    raise AssertionError("no worker process found")


@pytest.fixture(scope="module")
def rule(sim_model_dir, fast_profile):
    sim = SimRunner(sim_model_dir, load_profile("h200"), num_blocks=BLOCKS,
                    eos_probability=EOS_P, seed=SEED)
    return sim.rule, sim.max_model_len


@pytest.mark.parametrize("window", [2, 1, 3], ids=["async", "sync", "async-window3"])
def test_64_requests_match_the_reference_through_three_daemons(sim_model_dir, fast_profile, rule, window):
    token_rule, max_model_len = rule
    work = mixed_workload(64, token_rule.vocab_size, seed=1)
    aborted = set(range(3, 64, 10))
    with Serve(sim_model_dir, *flags("h200", window)) as serve:  # real step times: requests overlap
        outputs = run_all(serve, work, aborted)
        stats = wait_idle(serve, timeout_s=10)
        maps = worker_maps(serve)
    assert "libtorch" not in maps and "torch/lib" not in maps, "the sim worker loaded torch"
    assert stats.num_preemptions > 0, "the pool was meant to be too small"
    assert stats.prefix_hit_tokens > 0, "shared prefixes were meant to hit the cache"
    for i, (prompt, sampling) in enumerate(work):
        want = reference_output(token_rule, prompt, sampling, max_model_len)
        got = outputs[i]
        if i in aborted:
            assert got == want[: len(got)] and len(got) >= min(3, len(want)), f"aborted request {i}"
        else:
            assert got == want, f"request {i}"
