"""The sim runner under the real scheduler core: the same tokens as the pure-Python reference
in async and sync mode, with preemption, prefix hits and aborts; the same plan rules as the
torch runner; a device that runs one step at a time; no torch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from scheduler_service.core.config import PreemptionMode, SchedulerConfig
from scheduler_service.core.request import Request
from stepahead.plan import (
    GrammarPrep, NewRequest, RunningRequest, SamplingParams, StepPlan, StructuredKind, StructuredOutput,
)
from tests.integration.local_engine import LocalEngine
from tests.sim.workload import mixed_workload
from worker_service.plan_checks import PlanError
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner
from worker_service.sim.tokens import reference_output

BLOCK = 16


def runner(model_dir, profile, num_blocks=1024, eos_probability=0.05) -> SimRunner:
    return SimRunner(model_dir, load_profile(str(profile)), num_blocks=num_blocks, block_size=BLOCK,
                     eos_probability=eos_probability, seed=11)


def engine(sim: SimRunner, async_on: bool, **kw) -> LocalEngine:
    config = SchedulerConfig(num_gpu_blocks=sim.num_blocks, num_cpu_blocks=sim.num_host_blocks,
                             max_model_len=sim.max_model_len, block_size=BLOCK, max_num_batched_tokens=512,
                             async_scheduling=async_on, eos_token_ids=sim.eos_token_ids, **kw)
    return LocalEngine(sim, config)


def run(model_dir, profile, async_on: bool, num_blocks: int, abort: set[str] = frozenset(), **kw):
    sim = runner(model_dir, profile, num_blocks)
    e = engine(sim, async_on, **kw)
    work = mixed_workload(64, sim.vocab_size)
    for i, (prompt, sampling) in enumerate(work):
        e.add(Request(f"r{i}", prompt, sampling))

    def maybe_abort(step: int) -> None:
        if step == 6:
            for rid in abort:
                e.scheduler.abort(rid)

    e.run(before_step=maybe_abort)
    e.assert_no_leaks()
    return sim, e, work


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_async_sync_and_reference_agree_under_preemption(sim_model_dir, fast_profile, mode):
    outputs = []
    for async_on in (True, False):
        sim, e, work = run(sim_model_dir, fast_profile, async_on, num_blocks=40, preemption_mode=mode)
        stats = e.scheduler.stats()
        assert stats.num_preemptions > 0, "the pool was meant to be too small"
        assert stats.prefix_hit_tokens > 0, "shared prefixes were meant to hit the cache"
        outputs.append(dict(e.outputs))
    for i, (prompt, sampling) in enumerate(work):
        want = reference_output(sim.rule, prompt, sampling, sim.max_model_len)
        assert outputs[0][f"r{i}"] == outputs[1][f"r{i}"] == want, f"r{i}"
    lengths = {len(v) for v in outputs[0].values()}
    assert len(lengths) > 5 and any(len(outputs[0][f"r{i}"]) < s.max_tokens for i, (_, s) in enumerate(work))


def test_aborted_requests_get_a_prefix_of_the_reference(sim_model_dir, fast_profile):
    aborted = {f"r{i}" for i in range(0, 64, 8)}
    sim, e, work = run(sim_model_dir, fast_profile, True, num_blocks=1024, abort=aborted)
    for i, (prompt, sampling) in enumerate(work):
        want = reference_output(sim.rule, prompt, sampling, sim.max_model_len)
        got = e.outputs[f"r{i}"]
        if f"r{i}" in aborted:
            assert got == want[: len(got)] and len(got) < len(want), f"r{i}"
        else:
            assert got == want, f"r{i}"


def test_min_tokens_masks_eos_and_stop_ids(sim_model_dir, fast_profile):
    sim = runner(sim_model_dir, fast_profile, eos_probability=1.0)
    eos = sim.eos_token_ids[0]
    s = SamplingParams(max_tokens=10, min_tokens=3)
    out = reference_output(sim.rule, [7, 8, 9], s, sim.max_model_len)
    assert out[:3] != [eos] * 3 and eos not in out[:3] and out[3] == eos and len(out) == 4


def plan(step_id: int, *new: NewRequest, running=(), finished=()) -> StepPlan:
    return StepPlan(step_id, new_requests=new, running=running, finished_ids=finished)


def new(rid: str, n: int, blocks=(0,)) -> NewRequest:
    return NewRequest(rid, tuple(range(5, 5 + n)), SamplingParams(max_tokens=4), tuple(blocks), 0, n)


@pytest.mark.parametrize("bad,message", [
    (plan(2, new("a", 3)), "already known"),
    (plan(2, running=(RunningRequest("zz", (), 1),)), "unknown to the worker"),
    (plan(2, new("b", 3, blocks=(10**6,))), "outside the device pool"),
    (plan(2, new("b", 40, blocks=(1,))), "too short"),
    (plan(2, running=(RunningRequest("a", (), 2),)), "worker knows only"),
    (StepPlan(2, grammars=(GrammarPrep("g", StructuredOutput(StructuredKind.REGEX, "a+")),)),
     "grammars: this worker prepares none"),  # its hello says so: the scheduler never orders one
])
def test_bad_plans_are_rejected_with_the_torch_runners_rules(sim_model_dir, fast_profile, bad, message):
    sim = runner(sim_model_dir, fast_profile)
    sim.execute(plan(1, new("a", 3)))
    with pytest.raises(PlanError, match=message):
        sim.launch(bad)
    assert sim.requests["a"].num_computed == 3  # nothing was applied


def test_placeholder_needs_a_request_that_sampled_in_the_previous_step(sim_model_dir, fast_profile):
    sim = runner(sim_model_dir, fast_profile)
    sim.execute(plan(1, new("a", 3), new("b", 3, blocks=(1,))))
    sim.execute(plan(2, running=(RunningRequest("a", (), 1, input_is_placeholder=True),)))
    with pytest.raises(PlanError, match="placeholder"):
        sim.launch(plan(3, running=(RunningRequest("b", (), 1, input_is_placeholder=True),)))


def decode(rid: str, blocks=()) -> RunningRequest:
    return RunningRequest(rid, blocks, 1, input_is_placeholder=True)


STEADY = (decode("a"), decode("b"), decode("c", (3,)))  # c's 17th token needs its second block


@pytest.mark.parametrize("bad,message", [
    ((decode("a"), decode("b"), decode("c")), "too short"),
    ((decode("a"), decode("b"), decode("c", (10**6,))), "outside the device pool"),
    ((*STEADY, decode("a")), "appears twice"),
    ((*STEADY, decode("zz")), "unknown to the worker"),
    ((*STEADY, decode("e", (9,))), "max model length"),
    ((*STEADY, decode("f")), "placeholder"),
])
def test_steady_decodes_are_checked_by_the_torch_runners_rules(sim_model_dir, fast_profile, bad, message):
    """The async loop's steady decodes are checked column by column (`_steady_decodes`), every
    other plan row by row (`check_plan`): a steady plan with one bad row is refused with
    check_plan's reason, and nothing of it is applied."""
    sim = SimRunner(sim_model_dir, load_profile(str(fast_profile)), num_blocks=1024, block_size=BLOCK,
                    max_model_len=17, seed=11)
    partial = NewRequest("f", tuple(range(5, 25)), SamplingParams(max_tokens=4), (5, 6), 0, 10)  # half a prefill
    sim.execute(plan(1, new("a", 3), new("b", 3, blocks=(1,)), new("c", 16, blocks=(2,)),
                     new("e", 17, blocks=(7, 8)), partial))
    assert sim._steady_decodes(plan(2, running=STEADY)) is not None, "the valid plan takes the column path"
    before = {rid: (r.num_computed, list(r.block_ids), list(r.token_ids)) for rid, r in sim.requests.items()}
    with pytest.raises(PlanError, match=message):
        sim.launch(plan(2, running=bad))
    assert {rid: (r.num_computed, list(r.block_ids), list(r.token_ids)) for rid, r in sim.requests.items()} == before
    result = sim.execute(plan(2, running=STEADY))  # the runner is unharmed
    assert set(result.sampled_token_ids) == {"a", "b", "c"} and sim.requests["c"].block_ids == [2, 3]


def test_device_runs_one_step_at_a_time_and_waits_without_cpu(sim_model_dir):
    sim = SimRunner(sim_model_dir, load_profile("a100"), num_blocks=4096, block_size=BLOCK)
    prompt = NewRequest("a", tuple(range(5, 4005)), SamplingParams(max_tokens=4), tuple(range(251)), 0, 4000)
    first = sim.launch(plan(1, prompt))
    second = sim.launch(plan(2, running=(RunningRequest("a", (), 1, input_is_placeholder=True),)))
    cpu0, wall0 = time.process_time(), time.monotonic()
    r1, r2 = first.wait(), second.wait()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert r1.timing.device_busy_s > 0.05, "a 4000-token prefill of an 8B model takes tens of ms on an A100"
    assert r2.timing.forward_start == pytest.approx(r1.timing.forward_end, abs=1e-6), "the device is serial"
    assert r2.timing.forward_end - r1.timing.forward_start == pytest.approx(
        r1.timing.device_busy_s + r2.timing.device_busy_s, abs=1e-6)
    assert wall >= r1.timing.device_busy_s and cpu < 0.25 * wall, (cpu, wall)


def test_the_sim_worker_imports_no_torch(sim_model_dir):
    code = f"""
import sys
from worker_service.config import WorkerConfig
from worker_service.runners import build_runner, worker_info
from stepahead.plan import NewRequest, SamplingParams, StepPlan
runner, model_dir = build_runner(WorkerConfig(device="sim", sim_profile="h200", model={str(sim_model_dir)!r}))
info = worker_info(WorkerConfig(device="sim"), runner, model_dir)
result = runner.execute(StepPlan(1, new_requests=(NewRequest("a", (5, 6, 7), SamplingParams(), (0,), 0, 3),)))
assert result.sampled_token_ids["a"] < info.vocab_size == 4096, result
assert info.dtype == "bfloat16" and info.device == "sim:h200" and info.num_device_blocks > 50_000, info
assert "torch" not in sys.modules, "the sim worker imported torch"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_bad_sampling_row_fails_alone_as_on_the_torch_worker(sim_model_dir, fast_profile):
    sim = runner(sim_model_dir, fast_profile)
    bad = NewRequest("bad", (5, 6, 7), SamplingParams(top_p=0.0, max_tokens=4), (1,), 0, 3)
    result = sim.execute(plan(1, new("a", 3), bad))
    assert set(result.sampled_token_ids) == {"a"} and "top_p" in result.failed["bad"]
    later = sim.execute(plan(2, running=(RunningRequest("a", (), 1, input_is_placeholder=True),
                                         RunningRequest("bad", (), 1))))
    assert set(later.sampled_token_ids) == {"a"}, "deltas of a failed request are skipped"


def test_structured_outputs_are_refused_alone(sim_model_dir, fast_profile):
    from stepahead.plan import StructuredKind, StructuredOutput
    from worker_service.sim.runner import STRUCTURED_UNSUPPORTED

    sim = runner(sim_model_dir, fast_profile)
    choice = SamplingParams(max_tokens=4, structured=StructuredOutput(StructuredKind.CHOICE, choices=("a",)))
    plan = StepPlan(0, new_requests=(NewRequest("g", (1, 2, 3), choice, (0,), 0, 3),
                                      NewRequest("free", (1, 2, 3), SamplingParams(max_tokens=4), (1,), 0, 3)))
    result = sim.execute(plan)
    assert result.failed == {"g": STRUCTURED_UNSUPPORTED} and set(result.sampled_token_ids) == {"free"}


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-sim", "mixtral-8x7b-sim"])
def test_the_moe_sim_models_serve_the_reference_tokens(name, sim_model_dir, fast_profile, tmp_path):
    """The built-in MoE geometries (config.json as `build_sim_model` writes it; the tokenizer is
    the one every sim model shares) load in the sim runner, size a KV pool on an H200 and run
    the workload to the reference tokens."""
    import json
    import shutil

    from model_zoo.sim_models import SIM_MODELS, sim_config

    model_dir = tmp_path / name
    shutil.copytree(sim_model_dir, model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k.endswith("token_id") or k == "stepahead_sim_only"}
    (model_dir / "config.json").write_text(json.dumps({**raw, **sim_config(SIM_MODELS[name])}))
    h200 = SimRunner(model_dir, load_profile("h200"), block_size=BLOCK)
    assert h200.geometry.expert_params > 0.9 * h200.geometry.num_parameters and h200.num_blocks > 1000
    sim, e, work = run(model_dir, fast_profile, True, num_blocks=1024)
    for i, (prompt, sampling) in enumerate(work):
        assert e.outputs[f"r{i}"] == reference_output(sim.rule, prompt, sampling, sim.max_model_len), f"r{i}"
