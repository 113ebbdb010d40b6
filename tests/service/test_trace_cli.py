"""`stepahead trace` against a running `stepahead serve`: it finds the scheduler's cluster
token in the file serve writes for its user, and a refused call is one line, not a traceback."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

from stepahead.v1 import common_pb2, generation_pb2


def _trace(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "trace", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_trace_finds_serves_token_and_refusal_is_one_line(serve, tmp_path):
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert sum(len(m.token_ids) for m in serve.gateway.Generate(request, timeout=60)) == 4
    env = {k: v for k, v in os.environ.items() if k != "STEPAHEAD_CLUSTER_TOKEN"}  # as a user's shell

    out = _trace("--target", serve.scheduler_addr, "--out", str(tmp_path / "t"), env=env)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["steps"] > 0 and (tmp_path / "t" / "trace.json").is_file()

    refused = _trace("--target", serve.scheduler_addr, "--out", str(tmp_path / "u"),
                     env=dict(env, STEPAHEAD_CLUSTER_TOKEN="not-the-token"))
    assert refused.returncode == 1
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "UNAUTHENTICATED" in refused.stderr and "STEPAHEAD_CLUSTER_TOKEN" in refused.stderr


def test_serves_run_file_is_private(serve):
    from cli import runfile

    entry = runfile.find(serve.scheduler_addr)
    assert entry is not None and entry["cluster_token"] == serve.cluster_token
    path = runfile.run_dir() / f"serve-{entry['pid']}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_bench_with_scheduler_finds_serves_token(serve, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STEPAHEAD_CLUSTER_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "cli", "bench", "--target", serve.gateway_addr,
                           "--scheduler", serve.scheduler_addr, "--num-prompts", "2", "--random-input-len", "8",
                           "--random-output-len", "4", "--disable-tqdm", "--result-filename",
                           str(tmp_path / "b.json")], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["completed"] == 2 and saved["device_sampled_tokens"] >= 8  # the counters were read


def test_an_out_that_cannot_be_a_directory_is_one_line_before_any_call(tmp_path):
    """`--out` naming a file (or a place that cannot hold one) was a traceback after the scheduler
    was asked; now exit 2, one line naming --out, and no scheduler is needed to find out."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    done = _trace("--target", "127.0.0.1:1", "--out", str(taken), env=dict(os.environ))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [f"stepahead trace: --out {taken}: File exists"]
