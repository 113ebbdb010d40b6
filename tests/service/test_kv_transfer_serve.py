"""`stepahead serve --prefill-replicas 1 --decode-replicas 2`: a prefill worker (its own KV
transfer port) and two decode workers; greedy output through them equals Hugging Face's,
whichever replica computed which token, and no daemon logs a problem."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.test_e2e import check_against_hf, random_prompts, run_concurrently
from worker_service.kv_loads import TEST_HOLD_ENV


def test_disaggregated_serve_matches_hf(tiny_model_dir, hf):  # noqa: F811
    serve = Serve(tiny_model_dir, "--prefill-replicas", "1", "--decode-replicas", "2", capture_stderr=True)
    try:
        assert len(serve.child_pids()) == 5, "scheduler, a prefill worker, two decode workers, the gateway"
        prompts = random_prompts(8, 20, 120, 4096, seed=7)
        max_tokens = [12 + i for i in range(len(prompts))]
        outputs = run_concurrently(serve.gateway, prompts, max_tokens)
        check_against_hf(hf, prompts, outputs, max_tokens)
        stats = serve.stats()
        assert stats.num_running == 0
        if "num_loaded_blocks" in stats.DESCRIPTOR.fields_by_name:  # a scheduler that reports its transfers
            assert stats.num_handoffs >= len(prompts) and stats.num_loaded_blocks > 0, stats
            assert stats.num_failed_loads == 0 and stats.num_loading == 0, stats
    finally:
        serve.close()
    assert serve.log_problems() == []


# 32 blocks of 8 tokens per worker: a turn fits, the next requests evict it into the host tier
SMALL_POOL = ("--num-gpu-blocks-override", "32", "--block-size", "8", "--max-num-batched-tokens", "64")


def test_disaggregated_with_host_tier_hits_matches_hf(tiny_model_dir, hf):  # noqa: F811
    """Prefixes evicted to host memory come back from there, on either side of the split."""
    first = random_prompts(1, 64, 64, 4096, seed=31)[0]
    others = random_prompts(4, 60, 70, 4096, seed=32)
    prompts = [first, *others, first + random_prompts(1, 20, 20, 4096, seed=33)[0]]
    max_tokens = [16] * len(prompts)
    with Serve(tiny_model_dir, "--prefill-replicas", "1", "--decode-replicas", "1", *SMALL_POOL,
               "--kv-offloading-size", "0.05", capture_stderr=True) as s:
        outputs = [run_concurrently(s.gateway, [p], [m])[0] for p, m in zip(prompts, max_tokens)]
        stats = s.stats()
    assert s.log_problems() == []
    check_against_hf(hf, prompts, outputs, max_tokens)
    assert stats.num_handoffs == len(prompts) and stats.num_failed_loads == 0, stats
    assert stats.prefix_host_hit_tokens >= 8 * 8, "the last turn was meant to find its prefix in a host tier"
    assert stats.num_free_blocks == stats.num_total_blocks


def role_pid(serve: Serve, role: str) -> int:
    """The pid of serve's worker started with `--role role`."""
    for pid in serve.child_pids():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--role" in args and args[args.index(b"--role") + 1] == role.encode():
            return pid
    raise AssertionError(f"no {role} worker among {serve.child_pids()}")


def test_a_prefill_worker_killed_mid_transfer_loses_no_token(tiny_model_dir, hf):  # noqa: F811
    """The decode worker's loads are held in flight (a test-only hold) while the prefill
    worker that holds their KV is killed: the loads fail, the decode replica computes those
    requests itself, and every stream still equals Hugging Face's."""
    prompts = random_prompts(4, 30, 60, 4096, seed=41)
    max_tokens = [10] * len(prompts)
    s = Serve(tiny_model_dir, "--prefill-replicas", "1", "--decode-replicas", "1", capture_stderr=True,
              env={TEST_HOLD_ENV: "3"})
    try:
        outputs: list = []
        client = threading.Thread(target=lambda: outputs.extend(run_concurrently(s.gateway, prompts, max_tokens)))
        client.start()
        deadline = time.monotonic() + 120
        while s.stats().num_loading == 0:  # wait for a load in flight (each is held 3 s)
            assert time.monotonic() < deadline, "no load ever started"
            assert client.is_alive(), "the requests ended before any load started"
        os.kill(role_pid(s, "prefill"), signal.SIGKILL)
        client.join(120)
        assert not client.is_alive()
        stats = s.stats()
    finally:
        s.close()
    check_against_hf(hf, prompts, outputs, max_tokens)
    assert stats.num_failed_loads >= 1, stats
    assert stats.num_free_blocks == stats.num_total_blocks
    problems = s.log_problems([r"worker_lost", r"kv_load_failed", r"prefill-worker.*(exited|died)", r"restarting"])
    assert problems == [], problems
