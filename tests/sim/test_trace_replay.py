"""Trace replay in `stepahead bench`: the Azure CSV and JSONL formats, speed-up, prefix
groups, and a replay against a sim-worker system with vLLM's result keys."""

from __future__ import annotations

import argparse
import json

import pytest

from cli import bench
from cli.datasets import TraceError, load_trace, trace_prompts
from tests.service.harness import Serve

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:47.5000000,40,5
2023-11-16 18:15:46.2500000,374,44
2023-11-16 18:15:48.0000000,12,0
"""


def test_azure_csv_is_sorted_relative_and_sped_up(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    trace = load_trace(path, speedup=2.0)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in trace] == [
        (0.0, 374, 44), (0.625, 40, 5), (0.875, 12, 1)]
    assert [r.prompt_len for r in load_trace(path, num_prompts=2)] == [374, 40]


def jsonl(tmp_path, rows) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_with_priorities_and_prefix_groups(tmp_path):
    path = jsonl(tmp_path, [
        {"arrival_s": 1.0, "prompt_len": 30, "output_len": 4, "priority": 2, "prefix_group": "a"},
        {"arrival_s": 1.5, "prompt_len": 20, "output_len": 3, "prefix_group": "a"},
        {"arrival_s": 2.0, "prompt_len": 25, "output_len": 3},
    ])
    trace = load_trace(path)
    assert [(r.arrival_s, r.priority, r.prefix_group) for r in trace] == [(0.0, 2, "a"), (0.5, 0, "a"), (1.0, 0, None)]
    prompts = trace_prompts(trace, 4096, seed=0)
    assert [len(p) for p in prompts] == [30, 20, 25]
    assert prompts[0][:19] == prompts[1][:19], "group 'a' shares its shortest prompt's length - 1"
    assert prompts[2][:19] != prompts[0][:19]
    assert prompts == trace_prompts(trace, 4096, seed=0) and all(5 <= t < 4096 for p in prompts for t in p)


@pytest.mark.parametrize("content,message", [
    ("TIMESTAMP,Context\n1,2\n", "CSV header lacks"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,0,4\n", "ContextTokens must be >= 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,x,4\n", "ContextTokens must be an integer"),
])
def test_bad_csv_names_the_line_and_field(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


@pytest.mark.parametrize("row,message", [
    ('{"arrival_s": 0, "prompt_len": 3}', ":1: missing output_len"),
    ('{"arrival_s": "soon", "prompt_len": 3, "output_len": 1}', "arrival_s must be a finite number"),
    ('{"arrival_s": 0, "prompt_len": 3, "output_len": 1, "priority": 1.5}', "priority must be an integer"),
    ('[1, 2]', "expected a JSON object"),
    ('{oops', "not JSON"),
])
def test_bad_jsonl_names_the_line_and_field(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(TraceError, match=message):
        load_trace(path)


@pytest.mark.parametrize("command", ["simulate", "bench"])
def test_a_trace_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, command):
    """The commands' answer to a bad trace file (it was the TraceError's traceback)."""
    import subprocess
    import sys

    missing = tmp_path / "missing.csv"
    done = subprocess.run([sys.executable, "-m", "cli", command, "--dataset-path", str(missing),
                           *(["--dataset-name", "trace", "--target", "127.0.0.1:1"] if command == "bench" else [])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"stepahead {command}: error: trace file {missing} does not exist"]


def bench_args(path: str, serve, num_prompts: int, result: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--target", serve.gateway_addr, "--scheduler", serve.scheduler_addr, f"--cluster-token={serve.cluster_token}",
                              "--dataset-name", "trace", "--dataset-path", path, "--trace-speedup", "4",
                              "--num-prompts", str(num_prompts), "--disable-tqdm", "--result-filename", result])


def offline(sim_model_dir, path: str, num_prompts: int) -> dict:
    from scheduler_service.server import SchedulerDaemonConfig
    from stepahead import config as cfg
    from cli import simulate

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["--dataset-path", path, "--trace-speedup", "4", "--num-prompts", str(num_prompts),
                              "--model", str(sim_model_dir), "--sim-profile", "h200"])
    return simulate.simulate(cfg.from_args(simulate.SimulateConfig, args), cfg.from_args(SchedulerDaemonConfig, args))


def test_replay_against_a_sim_system(sim_model_dir, tmp_path):
    rows = [{"arrival_s": i * 0.04, "prompt_len": 20 + (i * 37) % 200, "output_len": 5 + (i * 13) % 40,
             "priority": i % 3, "prefix_group": f"g{i % 4}" if i % 2 else None} for i in range(40)]
    path = jsonl(tmp_path, [{k: v for k, v in r.items() if v is not None} for r in rows])
    result = str(tmp_path / "replay.json")
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", "h200") as serve:
        summary = bench.bench(bench_args(path, serve, 32, result))
        stats = serve.stats()
    assert summary["completed"] == 32 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(r["output_len"] for r in rows[:32]), "EOS must be ignored"
    assert summary["total_input_tokens"] == sum(r["prompt_len"] for r in rows[:32])
    assert stats.prefix_hit_tokens > 0, "prefix groups share their prompts' heads"
    for key in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "median_itl_ms", "request_throughput", "duration", "mean_e2el_ms"):
        assert summary[key] > 0, key
    assert summary["duration"] >= rows[31]["arrival_s"] / 4, "arrivals follow the sped-up trace"
    assert 0 < summary["device_utilization"] <= 1.0
    assert summary["device_busy_s"] > 0 and summary["device_sampled_tokens"] >= summary["total_output_tokens"]

    # the offline simulator agrees with the real-time system on token counts and request order
    real = json.loads(open(result).read())["requests"]
    predicted = offline(sim_model_dir, path, 32)["requests"]
    assert [r["output_len"] for r in real] == [len(p["token_times"]) for p in predicted]
    t0 = min(r["start"] for r in real)
    real_first = [r["first_token"] - t0 for r in real]
    sim_first = [p["token_times"][0] for p in predicted]
    pairs = [(i, j) for i in range(32) for j in range(32) if sim_first[j] - sim_first[i] > 0.05]
    assert len(pairs) > 100
    assert all(real_first[i] < real_first[j] for i, j in pairs), "first tokens came in another order"
