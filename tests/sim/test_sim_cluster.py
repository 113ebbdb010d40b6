"""`stepahead simulate`'s virtual cluster (`cli/virtual_cluster.py`): replicas on one clock."""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import random

import pytest

from cli import simulate
from cli.virtual_cluster import VirtualCluster


def write_trace(path, n: int, span_s: float, seed: int = 0, max_prompt: int = 600, max_output: int = 40) -> str:
    rng = random.Random(seed)
    times = sorted(rng.uniform(0, span_s) for _ in range(n))
    rows = [{"arrival_s": t, "prompt_len": rng.randint(16, max_prompt), "output_len": rng.randint(1, max_output),
             **({"prefix_group": f"g{i % 4}"} if i % 3 == 0 else {})} for i, t in enumerate(times)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def configs(sim_model_dir, trace: str, *flags: str):
    from scheduler_service.server import SchedulerDaemonConfig
    from stepahead import config as cfg

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["--dataset-path", trace, "--model", str(sim_model_dir), *flags])
    return cfg.from_args(simulate.SimulateConfig, args), cfg.from_args(SchedulerDaemonConfig, args)


def run(sim_model_dir, trace: str, *flags: str) -> dict:
    return simulate.simulate(*configs(sim_model_dir, trace, *flags))


def reference_single_replica(runner, sched_config, arrivals) -> None:
    """The single-replica simulator's loop as it was before the cluster (a free control plane):
    arrivals at the scheduler, plan while the window has room, commit one result at a time."""
    from scheduler_service.core.scheduler import RequestRejected, Scheduler
    from scheduler_service.step_loop import StepLoop
    from stepahead.plan import StepResult, WorkerTiming

    now = 0.0
    scheduler = Scheduler(sched_config, clock=lambda: now)
    loop = StepLoop(scheduler)
    device, device_free, after_commit, logs = collections.deque(), 0.0, False, {}
    pending = [(t, i, request, log) for i, (t, request, log) in enumerate(arrivals)]
    heapq.heapify(pending)
    while pending or device or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= now:
            _, _, request, log = heapq.heappop(pending)
            try:
                scheduler.add_request(request)
            except RequestRejected as exc:
                log.finish, log.finish_reason = now, f"REJECTED: {exc}"
                continue
            logs[request.request_id] = log
        on_commit, after_commit = after_commit, False
        while (plan := loop.plan_next(on_commit)) is not None:
            for r in plan.new_requests:
                log = logs[r.request_id]
                log.first_scheduled = now if log.first_scheduled is None else log.first_scheduled
            sampled, seconds, failed = runner.apply(plan)
            start = max(now, device_free)
            device_free = start + seconds
            device.append((StepResult(plan.step_id, sampled, failed=failed, speculation=runner.last_speculation,
                                      timing=WorkerTiming(forward_start=start, forward_end=device_free)), device_free))
        times = ([device[0][1]] if device else []) + ([pending[0][0]] if pending else [])
        if not times:
            assert not scheduler.has_unfinished_requests()
            return
        now = max(now, min(times))
        if device and device[0][1] <= now:
            _, events = loop.commit(device.popleft()[0])
            after_commit = True
            for event in events:
                log = logs[event.request_id]
                log.token_times += [now] * len(event.new_token_ids)
                if event.finish_reason is not None:
                    log.finish, log.finish_reason = now, event.finish_reason.name


def arrivals_of(config, vocab_size: int):
    from cli.datasets import load_trace, trace_prompts
    from scheduler_service.core.request import Request
    from stepahead.plan import SamplingParams

    trace = load_trace(config.dataset_path)
    out = []
    for i, (r, prompt) in enumerate(zip(trace, trace_prompts(trace, vocab_size, config.seed))):
        sampling = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        out.append((r.arrival_s, Request(f"req-{i}", prompt, sampling),
                    simulate.SimRequestLog(i, r.arrival_s, r.prompt_len, r.priority, r.output_len)))
    return out


def timeline(logs) -> list[tuple]:
    return [(g.token_times, g.first_scheduled, g.finish, g.finish_reason) for g in logs]


def test_one_replica_cluster_equals_the_single_replica_simulator(sim_model_dir, tmp_path):
    """The cluster with one replica replays a trace event for event as the single-replica loop did
    (a small pool, so preemptions and prefix hits are part of it)."""
    trace = write_trace(tmp_path / "t.jsonl", 120, span_s=1.5)
    flags = ("--sim-profile", "a100", "--num-gpu-blocks-override", "300")
    config, sched_flags = configs(sim_model_dir, trace, *flags)
    runner, sched_config, _ = simulate.build(config, sched_flags)
    expected = arrivals_of(config, runner.vocab_size)
    reference_single_replica(runner, sched_config, expected)

    runner, sched_config, _ = simulate.build(config, sched_flags)
    cluster = VirtualCluster([("only", runner, sched_config, simulate.WorkerRole.BOTH)])
    got = arrivals_of(config, runner.vocab_size)
    cluster.run(got)
    assert timeline(log for _, _, log in got) == timeline(log for _, _, log in expected)

    result = run(sim_model_dir, trace, *flags, "--replicas", "1")
    assert [(r["token_times"], r["first_scheduled"], r["finish"], r["finish_reason"]) for r in result["requests"]] \
        == timeline(log for _, _, log in expected)
    assert result["num_preemptions"] > 0 and "replicas" not in result


def test_aggregated_replicas_finish_every_request(sim_model_dir, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 300, span_s=2)
    one = run(sim_model_dir, trace, "--sim-profile", "a100", "--num-gpu-blocks-override", "400")
    four = run(sim_model_dir, trace, "--sim-profile", "a100", "--num-gpu-blocks-override", "400", "--replicas", "4")
    wanted = [json.loads(line)["output_len"] for line in open(trace)]
    assert four["completed"] == 300 and four["failed"] == 0
    assert [len(r["token_times"]) for r in four["requests"]] == wanted
    # least loaded routing spreads the requests; every replica did work
    served = {r["name"]: r["num_requests"] for r in four["replicas"]}
    assert sorted(served) == ["both-0", "both-1", "both-2", "both-3"] and min(served.values()) >= 50
    assert all(r["num_steps"] > 0 and 0 < r["device_utilization"] <= 1 for r in four["replicas"])
    assert four["median_ttft_ms"] < one["median_ttft_ms"] and four["duration"] < one["duration"]
    for r in four["requests"]:
        assert r["arrival"] <= r["first_scheduled"] <= r["token_times"][0] <= r["finish"]


@pytest.mark.parametrize("flags, message", [
    (("--sim-profile", "nope"), "sim profile 'nope' is neither a built-in (h100, h200, a100) nor a file"),
    (("--kv-link", "nope"), "sim link 'nope' is neither a built-in (nvlink, ib, pcie) nor a file"),
    (("--result-filename", "{tmp}/a-file/r.json"), "--result-filename {tmp}/a-file/r.json: File exists"),
])
def test_simulates_operator_errors_are_one_line_before_the_run(sim_model_dir, tmp_path, flags, message):
    """They were tracebacks (the profile's ValueError; the result file's, after the whole run), and
    a bad --kv-link passed unseen without disaggregation."""
    import subprocess
    import sys

    (tmp_path / "a-file").write_text("")
    trace = write_trace(tmp_path / "t.jsonl", 3, span_s=1)
    done = subprocess.run([sys.executable, "-m", "cli", "simulate", "--dataset-path", trace, "--model",
                           str(sim_model_dir), *(f.format(tmp=tmp_path) for f in flags)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"stepahead simulate: error: {message.format(tmp=tmp_path)}"]


def test_replica_flags_are_checked(sim_model_dir, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", 3, span_s=1)
    for flags in (("--replicas", "0"), ("--prefill-replicas", "1"), ("--decode-replicas", "2"),
                  ("--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2")):
        with pytest.raises(SystemExit):
            run(sim_model_dir, trace, *flags)


def test_long_prompt_trace_is_seeded_and_scales_with_the_rate(tmp_path):
    from cli.datasets import load_trace, long_prompt_trace, write_jsonl_trace

    slow, fast = long_prompt_trace(400, 2.0, seed=7), long_prompt_trace(400, 8.0, seed=7)
    assert [(r.prompt_len, r.output_len) for r in slow] == [(r.prompt_len, r.output_len) for r in fast]
    assert all(abs(a.arrival_s - 4 * b.arrival_s) < 1e-9 for a, b in zip(slow, fast))
    assert long_prompt_trace(400, 2.0, seed=8) != slow
    prompts, outputs = sorted(r.prompt_len for r in slow), sorted(r.output_len for r in slow)
    assert 1700 < prompts[200] < 2400 and 10 <= outputs[200] <= 40  # ~2k-token prompts, tens of output tokens
    assert all(r.prompt_len + r.output_len <= 8192 for r in slow)
    capped = long_prompt_trace(200, 1.0, seed=7, max_model_len=2048)
    assert max(r.prompt_len + r.output_len for r in capped) == 2048
    assert 1.5 < 400 / slow[-1].arrival_s < 2.5  # Poisson at 2 per second
    assert load_trace(write_jsonl_trace(tmp_path / "t.jsonl", slow)) == slow


def run_cluster(sim_model_dir, trace: str, *flags: str):
    """(the cluster after replaying `trace`, its arrivals (time, Request, log))."""
    config, sched_flags = configs(sim_model_dir, trace, *flags)
    cluster, _ = simulate.build_cluster(config, sched_flags)
    arrivals = arrivals_of(config, cluster.replicas[0].runner.vocab_size)
    cluster.run(arrivals)
    return cluster, arrivals


def outputs(cluster, arrivals) -> list[tuple[int, ...]]:
    return [tuple(cluster.requests[request.request_id].output_token_ids) for _, request, _ in arrivals]


DISAGG = ("--prefill-replicas", "1", "--decode-replicas", "1")


def test_disaggregated_replicas_give_the_aggregated_tokens(sim_model_dir, tmp_path):
    """1 prefill + 1 decode replica: every request finishes with the very tokens of an aggregated
    run (the sim's tokens are a function of the request's tokens: an oracle), its first token
    sampled on the prefill replica and the rest on the decode replica, each prompt's KV moved
    once over the link and its source blocks released."""
    trace = write_trace(tmp_path / "t.jsonl", 150, span_s=1.5)
    wanted = [json.loads(line)["output_len"] for line in open(trace)]
    agg, agg_arrivals = run_cluster(sim_model_dir, trace, "--sim-profile", "a100", "--replicas", "2")
    dis, dis_arrivals = run_cluster(sim_model_dir, trace, "--sim-profile", "a100", *DISAGG)
    assert [len(t) for t in outputs(dis, dis_arrivals)] == wanted
    assert outputs(dis, dis_arrivals) == outputs(agg, agg_arrivals)
    handed = [log for _, _, log in dis_arrivals if log.decode_replica]
    assert {log.replica for _, _, log in dis_arrivals} == {"prefill-0"}
    assert len(handed) == sum(n > 1 for n in wanted) and {log.decode_replica for log in handed} == {"decode-0"}
    assert len(dis.transfers) == len(handed) and all(t.end is not None for t in dis.transfers)
    for replica in dis.replicas:
        assert not replica.scheduler.has_unfinished_requests()
        replica.scheduler.check_integrity()
    prefill = dis.replicas[0].scheduler
    assert prefill.stats().num_free_blocks == prefill.config.num_gpu_blocks, "every handed-off block released"


def test_ttft_includes_the_prefill_and_the_link_prices_each_transfer(sim_model_dir, tmp_path):
    """Requests one at a time: the first token comes from the prefill replica when the aggregated
    replica would give it (the same prefill), the second only after the KV crossed the link, and
    each transfer takes the link's time for the prompt's blocks."""
    from worker_service.sim.profiles import load_link_profile

    rows = [{"arrival_s": 2.0 * i, "prompt_len": 200 + 150 * i, "output_len": 5} for i in range(6)]
    path = tmp_path / "sparse.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for link in ("ib", "pcie"):
        agg, agg_arrivals = run_cluster(sim_model_dir, str(path), "--sim-profile", "h200")
        dis, dis_arrivals = run_cluster(sim_model_dir, str(path), "--sim-profile", "h200", "--kv-link", link, *DISAGG)
        assert outputs(dis, dis_arrivals) == outputs(agg, agg_arrivals)
        price = load_link_profile(link).transfer_seconds
        block_bytes = dis.replicas[0].runner.kv_bytes_per_block
        assert dis.link.name == link and len(dis.transfers) == len(rows)
        for (_, _, a), (_, _, d), transfer, row in zip(agg_arrivals, dis_arrivals, dis.transfers, rows):
            assert d.token_times[0] == a.token_times[0]  # TTFT: the prompt's prefill, on the prefill replica
            assert d.token_times[0] - d.arrival > 0.005  # and a 200+ token prefill of an 8B model takes time
            assert transfer.num_blocks == -(-row["prompt_len"] // 16)
            assert transfer.nbytes == transfer.num_blocks * block_bytes
            assert transfer.end - transfer.start == pytest.approx(price(transfer.nbytes), rel=1e-12)
            assert d.token_times[0] <= transfer.ready <= transfer.start  # the decode replica's plan started it
            assert d.token_times[1] > transfer.end  # the decode needs the KV
            assert d.token_times[1] > a.token_times[1]


def test_disaggregated_runs_end_under_pressure(sim_model_dir, tmp_path):
    """A burst into small KV pools, two prefill replicas handing off to one decode replica:
    the run ends with every request complete (or says it stalled: never spins)."""
    trace = write_trace(tmp_path / "t.jsonl", 120, span_s=0.05, max_prompt=900, max_output=60)
    result = run(sim_model_dir, trace, "--sim-profile", "a100", "--num-gpu-blocks-override", "300",
                 "--prefill-replicas", "2", "--decode-replicas", "1")
    assert result["completed"] == 120 and result["failed"] == 0
    assert [len(r["token_times"]) for r in result["requests"]] == [json.loads(line)["output_len"]
                                                                    for line in open(trace)]
    assert result["kv_transfers"]["num_completed"] == result["kv_transfers"]["num_transfers"] > 0
    assert {r["name"]: r["role"] for r in result["replicas"]} == {"prefill-0": "prefill", "prefill-1": "prefill",
                                                                  "decode-0": "decode"}
