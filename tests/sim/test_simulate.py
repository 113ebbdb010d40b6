"""`stepahead simulate`: the real scheduler core on a virtual clock against the cost model."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from cli import simulate


def write_trace(path, n: int, span_s: float, seed: int = 0, classes: bool = False, max_output: int = 200) -> str:
    rng = random.Random(seed)
    times = sorted(rng.uniform(0, span_s) for _ in range(n))
    rows = [{"arrival_s": t, "prompt_len": rng.randint(16, 600), "output_len": rng.randint(1, max_output),
             **({"priority": rng.choice([0, 1, 1, 2, 2, 2])} if classes else {}),
             **({"prefix_group": f"g{i % 5}"} if i % 3 == 0 else {})} for i, t in enumerate(times)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    return parser.parse_args(list(flags))


def run(sim_model_dir, trace: str, *flags: str) -> dict:
    from scheduler_service.server import SchedulerDaemonConfig
    from stepahead import config as cfg

    args = parse("--dataset-path", trace, "--model", str(sim_model_dir), *flags)
    return simulate.simulate(cfg.from_args(simulate.SimulateConfig, args), cfg.from_args(SchedulerDaemonConfig, args))


def test_deterministic_and_complete(sim_model_dir, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 300, span_s=3)
    first = run(sim_model_dir, trace, "--sim-profile", "a100", "--num-gpu-blocks-override", "400")
    again = run(sim_model_dir, trace, "--sim-profile", "a100", "--num-gpu-blocks-override", "400")
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert first["completed"] == 300 and first["failed"] == 0 and first["num_preemptions"] > 0
    wanted = [json.loads(line)["output_len"] for line in open(trace)]
    assert [len(r["token_times"]) for r in first["requests"]] == wanted, "max_tokens = output_len, EOS ignored"
    assert 0 < first["device_utilization"] <= 1.0
    for r in first["requests"]:
        assert r["arrival"] <= r["first_scheduled"] <= r["token_times"][0] <= r["finish"]


def test_an_hour_of_trace_runs_on_the_virtual_clock(sim_model_dir, tmp_path):
    trace = write_trace(tmp_path / "hour.jsonl", 500, span_s=3600, max_output=40)
    result = run(sim_model_dir, trace, "--sim-profile", "h200")
    assert result["completed"] == 500 and result["duration"] > 3500  # virtual seconds
    # ~20 decode steps of ~4 ms (one read of the weights each) per request, mostly alone
    assert 0.005 < result["device_utilization"] < 0.05


def test_faster_device_means_lower_latency(sim_model_dir, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 200, span_s=10)
    a100 = run(sim_model_dir, trace, "--sim-profile", "a100")
    h200 = run(sim_model_dir, trace, "--sim-profile", "h200")
    assert h200["median_tpot_ms"] < a100["median_tpot_ms"] and h200["median_ttft_ms"] < a100["median_ttft_ms"]


def test_priority_policy_serves_class_0_first_under_overload(sim_model_dir, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 600, span_s=5, classes=True)
    fcfs = run(sim_model_dir, trace, "--sim-profile", "a100", "--max-num-seqs", "32")
    prio = run(sim_model_dir, trace, "--sim-profile", "a100", "--max-num-seqs", "32",
               "--scheduling-policy", "priority")
    assert prio["by_priority"]["0"]["p99_ttft_ms"] < fcfs["by_priority"]["0"]["p99_ttft_ms"]
    assert prio["by_priority"]["0"]["median_ttft_ms"] < prio["by_priority"]["2"]["median_ttft_ms"]


def test_rejected_requests_are_reported(sim_model_dir, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 10, "output_len": 3}\n'
                    '{"arrival_s": 1, "prompt_len": 9000, "output_len": 3}\n')
    result = run(sim_model_dir, str(path))
    assert result["completed"] == 1 and result["failed"] == 1 and "9000 tokens" in result["errors"][0]


@pytest.mark.parametrize("flag", ["--no-async-scheduling", "--async-scheduling"])
def test_scheduler_flags_reach_the_core(sim_model_dir, tmp_path, flag):
    trace = write_trace(tmp_path / "t.jsonl", 50, span_s=1)
    result = run(sim_model_dir, trace, flag, "--max-num-batched-tokens", "256")
    assert result["config"]["dataset_path"] == trace and result["completed"] == 50


@pytest.mark.parametrize("async_on", [True, False])
def test_control_plane_latencies_add_up_for_a_lone_request(sim_model_dir, tmp_path, async_on):
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"arrival_s": 1.0, "prompt_len": 300, "output_len": 4}) + "\n")
    mode = "--async-scheduling" if async_on else "--no-async-scheduling"
    free = run(sim_model_dir, str(trace), "--sim-profile", "h200", mode)["requests"][0]
    flags = ("--sim-ingress-latency-ms", "4", "--sim-plan-latency-ms", "2", "--sim-result-latency-ms", "1.5",
             "--sim-egress-latency-ms", "3")
    slow = run(sim_model_dir, str(trace), "--sim-profile", "h200", mode, *flags)["requests"][0]
    ttft = lambda r: r["token_times"][0] - r["arrival"]  # noqa: E731
    # the prefill waits for the request (4) and its plan (2); its result is committed 1.5 after, seen 3 after that
    assert ttft(slow) == pytest.approx(ttft(free) + 0.0105, abs=1e-9)
    assert slow["first_scheduled"] - slow["arrival"] == pytest.approx(0.004, abs=1e-9)
    # async: the next step was planned a step ahead, the device never waits for a plan; synchronous:
    # each step is planned once the previous result is committed, so plan + result more per token
    gaps = lambda r: [b - a for a, b in zip(r["token_times"], r["token_times"][1:])]  # noqa: E731
    assert gaps(slow) == pytest.approx([g + (0 if async_on else 0.0035) for g in gaps(free)], abs=1e-9)


def test_negative_control_plane_latency_is_refused(sim_model_dir, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 3, span_s=1)
    with pytest.raises(SystemExit, match="latency"):
        run(sim_model_dir, trace, "--sim-profile", "h200", "--sim-egress-latency-ms", "-1")


def test_the_adaptive_window_deepens_only_when_the_device_waits(sim_model_dir, tmp_path):
    """Free control plane: the device never waits for a plan, so the adaptive window stays one
    step ahead (the same run as a fixed window of two). A control plane slower than a decode
    step: it plans deeper, and the device is busier than with the fixed window of two."""
    trace = write_trace(tmp_path / "t.jsonl", 120, span_s=1, max_output=120)
    common = ("--sim-profile", "h200", "--max-concurrent-batches", "3")
    two = ("--sim-profile", "h200", "--max-concurrent-batches", "2")
    strip = lambda r: {k: v for k, v in r.items() if k != "config"}  # noqa: E731
    assert strip(run(sim_model_dir, trace, *common)) == strip(run(sim_model_dir, trace, *two))
    slow = ("--sim-plan-latency-ms", "4", "--sim-result-latency-ms", "4")
    adaptive = run(sim_model_dir, trace, *common, *slow)
    fixed_two = run(sim_model_dir, trace, *two, *slow)
    fixed_three = run(sim_model_dir, trace, *common, "--no-adaptive-concurrent-batches", *slow)
    assert adaptive["device_utilization"] > fixed_two["device_utilization"] + 0.05
    assert adaptive["device_utilization"] == pytest.approx(fixed_three["device_utilization"], abs=0.03)
    assert [len(r["token_times"]) for r in adaptive["requests"]] == [len(r["token_times"]) for r in fixed_two["requests"]]
