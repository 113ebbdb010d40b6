"""Tensor parallelism through all three daemons: `stepahead serve --tensor-parallel-size 2`
starts two worker processes that the scheduler groups into one replica (gloo on CPU).

Greedy tokens equal Hugging Face's with chunked prefill, preemption and async scheduling
on; a rank killed with SIGKILL mid-run loses nothing (its group is dropped, the requests
move, the supervisor restarts the rank and the group re-forms); a model that does not
split makes the worker exit naming the dimension. The default suite runs the llama case
only; the other families, TP x DP, the kill and the exit on a bad geometry are `slow`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from stepahead.v1 import scheduler_pb2
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from testing.checkpoints import VARIANTS, build_checkpoint
from tests.service.harness import Serve
from tests.service.hf_oracle import HFGreedy
from tests.service.test_e2e import check_against_hf, random_prompts, run_concurrently

TP = ("--tensor-parallel-size", "2", "--num-threads", "1", "--distributed-timeout", "30")
SMALL_POOL = ("--num-gpu-blocks-override", "24", "--block-size", "8", "--max-num-batched-tokens", "64")


def family_checkpoint(name: str, tiny_dir: Path, out: Path) -> Path:
    """A random checkpoint of a test family, sized to the tiny tokenizer (copied beside it)."""
    model_type, overrides = VARIANTS[name]
    build_checkpoint(out, model_type, seed=6, **dict(overrides, vocab_size=4096))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_dir / f).exists():
            shutil.copy(tiny_dir / f, out / f)
    return out


def run_and_check(model_dir: Path, vocab: int, *flags: str, num: int = 6, seed: int = 8, also=None) -> None:
    prompts = random_prompts(num, 20, 90, vocab, seed=seed)
    max_tokens = [20] * num
    with Serve(model_dir, *TP, *SMALL_POOL, *flags, capture_stderr=True) as s:
        outputs = run_concurrently(s.gateway, prompts, max_tokens)
        if also is not None:
            also(s)
        stats = s.stats()
        lanes = s.scheduler.GetFlightRecord(scheduler_pb2.GetFlightRecordRequest(), timeout=10).worker_id
    problems = s.log_problems()  # nothing at warning or above: no step failed, no rank lost
    assert not problems, problems
    assert lanes.startswith("tp"), f"the replica is not a tensor-parallel group: {lanes}"
    assert stats.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    assert stats.num_free_blocks == stats.num_total_blocks
    check_against_hf(HFGreedy(model_dir), prompts, outputs, max_tokens)


def test_tp2_llama_matches_hf_with_chunking_swap_and_async(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    run_and_check(tiny_model_dir, len(tiny_tokenizer), "--preemption-mode", "swap", also=join_requests_are_checked)


def join_requests_are_checked(s: Serve) -> None:
    """A JoinGroup that could never form a sane group is refused, naming the field."""
    for bad, field in [(dict(tensor_parallel_size=1, rendezvous_port=5), "tensor_parallel_size"),
                       (dict(tensor_parallel_size=5000, rendezvous_port=5), "tensor_parallel_size"),
                       (dict(tensor_parallel_size=2, rendezvous_port=0), "rendezvous_port")]:
        with pytest.raises(grpc.RpcError) as err:
            s.scheduler.JoinGroup(scheduler_pb2.JoinGroupRequest(worker_id="probe", **bad), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_tp2_expert_parallel_mixtral_matches_hf(tiny_model_dir, tiny_tokenizer, tmp_path):  # noqa: F811
    """`--enable-expert-parallel`: each rank holds two of Mixtral's four experts whole."""
    model_dir = family_checkpoint("mixtral_tied_gqa2", tiny_model_dir, tmp_path / "mixtral")
    run_and_check(model_dir, len(tiny_tokenizer), "--enable-expert-parallel", "--preemption-mode", "recompute")


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", [("qwen2_untied_gqa4", "recompute"), ("qwen3_tied_gqa1", "swap"),
                                       ("qwen3_moe_untied_gqa2", "swap")])
def test_tp2_qwen_families_match_hf(tiny_model_dir, tiny_tokenizer, tmp_path, name, mode):  # noqa: F811
    model_dir = family_checkpoint(name, tiny_model_dir, tmp_path / name)
    run_and_check(model_dir, len(tiny_tokenizer), "--preemption-mode", mode)


def scheduler_metric(port: int, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name]
    return sum(values)


def worker_pids(serve: Serve) -> list[int]:
    return [p for p in serve.child_pids() if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[3:4] == [b"worker"]]


@pytest.mark.slow
def test_kill_one_rank_of_tp2_x_dp2_loses_nothing(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    """Four workers, two groups; SIGKILL one rank while requests stream: every request
    completes (moved to the other group, or to the re-formed one), token for token HF's."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.service.test_e2e import collect, greedy_request

    from stepahead.ports import free_port

    prompts = random_prompts(8, 20, 60, len(tiny_tokenizer), seed=9)
    metrics_port = free_port()
    with Serve(tiny_model_dir, *TP, "--data-parallel-size", "2", "--metrics-port", str(metrics_port)) as s:
        assert len(worker_pids(s)) == 4
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(collect, s.gateway, greedy_request(p, 64)) for p in prompts]
            poll = threading.Event()
            while s.stats().num_sampled_tokens < 40 and not futures[0].done():
                poll.wait(0.05)  # until tokens flow on the groups
            os.kill(worker_pids(s)[0], signal.SIGKILL)
            outputs = [f.result(timeout=300)[0] for f in futures]
        stats = s.stats()
        lost = scheduler_metric(metrics_port, "stepahead:workers_lost_total")
        moved = scheduler_metric(metrics_port, "stepahead:requests_migrated_total")
        poll = threading.Event()
        for _ in range(2400):  # the survivor re-joins with the restarted rank: two groups again
            if scheduler_metric(metrics_port, "stepahead:workers_attached") == 2:
                break
            poll.wait(0.05)
        assert scheduler_metric(metrics_port, "stepahead:workers_attached") == 2, "the group never re-formed"
    assert lost == 1 and moved >= 1, (lost, moved)
    assert stats.num_running == 0
    check_against_hf(HFGreedy(tiny_model_dir), prompts, outputs, [64] * len(prompts))


@pytest.mark.slow  # the default suite checks the refusal in process (tests/model/test_tensor_parallel.py)
def test_a_model_that_does_not_split_is_refused_naming_the_dimension(tiny_model_dir, tmp_path):  # noqa: F811
    bad = tmp_path / "twelve-heads"  # 12 query heads over tiny's 4 KV heads: a model, but not split 8 ways
    shutil.copytree(tiny_model_dir, bad)
    config = (bad / "config.json").read_text().replace('"num_attention_heads": 8', '"num_attention_heads": 12')
    (bad / "config.json").write_text(config)
    proc = subprocess.run([sys.executable, "-m", "cli", "worker", "--model", str(bad),
                           "--tensor-parallel-size", "8", "--scheduler", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "num_attention_heads (12) is not divisible by the tensor-parallel size 8" in proc.stderr, proc.stderr
