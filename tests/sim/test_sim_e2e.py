"""The sim worker through all three daemons (`stepahead serve --device sim`): 64 concurrent
requests with preemption (a small pool), shared prefixes and aborts give the reference
tokens in async mode (two and three plans in flight) and sync mode; the worker process never
maps torch."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stepahead.ports import free_port
from stepahead.plan import SamplingParams
from stepahead.v1 import common_pb2, generation_pb2
from tests.service.harness import Serve
from tests.service.streams import wait_idle
from tests.sim.workload import mixed_workload
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner
from worker_service.sim.tokens import reference_output

SEED, EOS_P, BLOCKS = 11, 0.05, 24


def flags(profile: str, window: int | str) -> list[str]:
    """`window`: plans in flight, fixed (1: the synchronous loop), or "auto": the default adaptive
    window (one step ahead, up to three while the device waits for plans)."""
    loop = (["--no-async-scheduling"] if window == 1 else ["--async-scheduling"] if window == "auto"
            else ["--async-scheduling", "--max-concurrent-batches", str(window), "--no-adaptive-concurrent-batches"])
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


@pytest.mark.parametrize("window", [2, 1, 3, "auto"], ids=["async", "sync", "async-window3", "async-adaptive"])
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


def scrape(port: int, name: str) -> dict[str, float]:
    """Samples of one metric family by their `replica` label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            out[labels[labels.index('replica="') + 9:].split('"')[0]] = float(value)
    return out


def test_a_control_plane_slower_than_the_device_deepens_the_window(sim_model_dir, fast_profile, rule):
    """Steps of microseconds: every plan made one step ahead comes late, so the adaptive window
    (the default) plans up to three ahead, says so in /metrics, and the tokens stay exact."""
    token_rule, max_model_len = rule
    work = mixed_workload(24, token_rule.vocab_size, seed=2)
    port = free_port()
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", str(fast_profile), "--sim-eos-probability",
               str(EOS_P), "--seed", str(SEED), "--metrics-port", str(port)) as serve:
        outputs = run_all(serve, work, set())
        late = scrape(port, "stepahead:late_plans_total")
        window = scrape(port, "stepahead:concurrent_batches")
    for (prompt, sampling), got in zip(work, outputs):
        assert got == reference_output(token_rule, prompt, sampling, max_model_len)
    assert sum(late.values()) > 0, "steps of microseconds: plans made one step ahead must come late"
    assert len(window) == 1 and set(window.values()) <= {2.0, 3.0}
