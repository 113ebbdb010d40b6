"""Every run finishes under overload (issue 37, point 1): the score policy's aged requests no
longer preempt one another, a waiting request no longer preempts for the step's token budget,
and a core that stops giving tokens says why (`Scheduler.stall`, `SimulationStalled`).

The hang it reproduces: a burst far past capacity, where nearly every waiting request has
aged. Aged requests could preempt anyone, and a waiting request whose step budget was spent
preempted running work to take that budget; so each step the aged queue head threw out a
running request still in its (re-)prefill, the victim aged again and did the same, and no
request got its next token ever again: the simulation ran on forever. Each run here is bounded
by a step cap, so the old code fails instead of hanging.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
from dataclasses import replace

import pytest

from scheduler_service.core import scheduler as scheduler_module
from scheduler_service.core.config import SchedulerConfig, SchedulingPolicy
from scheduler_service.core.policy import FcfsPolicy
from scheduler_service.core.request import Request, RequestStatus
from cli import simulate
from stepahead.plan import SamplingParams
from tests.unit.fake_executor import Driver, hashed_tokens

# a small replica far past capacity: 8 sequences, 128 tokens a step, aging after 0.5 s
OVERLOAD = ("--sim-profile", "h200", "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
            "--max-wait-time", "0.5", "--score-ttft-target", "2")


def burst_trace(path, n: int, seed: int = 0) -> str:
    """`n` requests within 0.2 s (prompts of 200-800 tokens, 4-40 output tokens, priority
    classes 0 / 1 / 2 in 1 : 2 : 3): minutes of work for the replica, so all of it ages."""
    rng = random.Random(seed)
    times = sorted(rng.uniform(0, 0.2) for _ in range(n))  # in arrival order: the requests' order in the result
    rows = [{"arrival_s": t, "prompt_len": rng.randint(200, 800), "output_len": rng.randint(4, 40),
             "priority": rng.choice([0, 1, 1, 2, 2, 2])} for t in times]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


class StepCap(AssertionError):
    pass


def bounded_run(monkeypatch, sim_model_dir, trace: str, policy: str, max_steps: int) -> tuple[dict, list[Request]]:
    """`stepahead simulate` on `trace`, failing once it has committed `max_steps` steps; the
    result and the scheduler's requests (their preemption counts)."""
    from scheduler_service.server import SchedulerDaemonConfig
    from stepahead import config as cfg

    seen: list[Request] = []

    class Bounded(simulate.VirtualSystem):
        def run(self, arrivals):
            seen.extend(request for _, request, _ in arrivals)
            super().run(arrivals)

        def _commit(self, replica):
            if self.num_steps >= max_steps:
                raise StepCap(f"{policy}: not finished after {max_steps} steps at t={self.now:.2f} s "
                              f"({self.scheduler.num_unfinished} requests unfinished, "
                              f"{self.scheduler.stats().num_preemptions} preemptions)")
            super()._commit(replica)

    monkeypatch.setattr(simulate, "VirtualSystem", Bounded)
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["--dataset-path", trace, "--model", str(sim_model_dir), "--scheduling-policy", policy,
                              *OVERLOAD])
    result = simulate.simulate(cfg.from_args(simulate.SimulateConfig, args), cfg.from_args(SchedulerDaemonConfig, args))
    return result, seen


def test_every_policy_finishes_a_burst_far_past_capacity(monkeypatch, sim_model_dir, tmp_path):
    """fcfs never preempts by policy: its step count is what the work takes. score and
    priority must finish the same trace in a small multiple of it (the old score policy
    livelocked here: 177 of the 200 requests never finished), with every request complete
    and preempted at most a few times."""
    trace = burst_trace(tmp_path / "burst.jsonl", 200)
    wanted = [json.loads(line)["output_len"] for line in open(trace)]
    fcfs, _ = bounded_run(monkeypatch, sim_model_dir, trace, "fcfs", max_steps=100_000)
    assert fcfs["completed"] == 200 and fcfs["num_preemptions"] == 0
    cap = 3 * fcfs["num_steps"]
    for policy in ("score", "priority"):
        result, requests = bounded_run(monkeypatch, sim_model_dir, trace, policy, max_steps=cap)
        assert result["completed"] == 200 and result["failed"] == 0, policy
        assert [len(r["token_times"]) for r in result["requests"]] == wanted, f"{policy}: every request complete"
        per_request = collections.Counter(r.num_preemptions for r in requests)
        assert max(per_request) <= 2, f"{policy}: preemptions per request {sorted(per_request.items())}"


def test_aged_requests_keep_their_turn():
    """An aged request preempts a request admitted ahead of its turn (the hog, never aged), but
    not one admitted on its own aged turn: among aged requests, queueing order, no cycle."""
    clock = [0.0]
    config = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4, max_num_seqs=1,
                             async_scheduling=False, scheduling_policy=SchedulingPolicy.SCORE, max_wait_time=2.0)
    d = Driver.create(config, hashed_tokens(1000), clock=lambda: clock[0])

    def add(rid: str, max_tokens: int) -> None:
        d.scheduler.add_request(Request(rid, range(1, 5), SamplingParams(max_tokens=max_tokens), 2, None))

    add("hog", 50)
    d.tick()
    add("first", 20)  # queued at 0: ages at 2
    clock[0] = 0.5
    add("second", 20)  # queued at 0.5: ages at 2.5
    clock[0] = 2.1
    d.tick()
    hog, first, second = (d.scheduler.get_request(r) for r in ("hog", "first", "second"))
    assert hog.status is RequestStatus.PREEMPTED and first.status is RequestStatus.RUNNING
    clock[0] = 3.0  # second has aged too; first runs on its aged turn
    for _ in range(5):
        d.tick()
        d.scheduler.check_integrity()
    assert first.status is RequestStatus.RUNNING and first.num_preemptions == 0
    assert second.status is RequestStatus.WAITING and second.num_preemptions == 0
    d.run_until_done()
    assert set(d.finished) == {"hog", "first", "second"}


class _PreemptsAnyone(FcfsPolicy):
    """A broken policy (a test double): any waiting request may preempt any running one,
    the score policy's aged rule before the fix, without the clock."""

    can_preempt_running = True

    def may_preempt(self, candidate: Request, victim: Request, now: float) -> bool:
        return True


# preemption_min_progress=0: without the protection of a once-preempted request
# (`preemption.py`), which would end the broken policy's cycle after one preemption
STALL_CONFIG = SchedulerConfig(num_gpu_blocks=64, max_model_len=256, block_size=4, max_num_seqs=1,
                               max_num_batched_tokens=64, enable_prefix_caching=False, async_scheduling=False,
                               preemption_min_progress=0)


def _two_long_prompts(d: Driver) -> None:
    for rid in ("a", "b"):
        d.scheduler.add_request(Request(rid, range(1, 101), SamplingParams(max_tokens=3), 0, None))


def test_a_core_that_only_throws_work_away_says_why(monkeypatch):
    """Two 100-token prompts, one sequence slot, 64 tokens a step, under a policy that lets
    either preempt the other: each step the waiting one throws out the other mid-prefill and
    no token ever comes. `stall()` names it once more steps passed than any run without lost
    work needs, instead of the core spinning on."""
    monkeypatch.setattr(scheduler_module, "make_policy", lambda config: _PreemptsAnyone())
    d = Driver.create(STALL_CONFIG, hashed_tokens(1000))
    _two_long_prompts(d)
    limit = scheduler_module.stall_limit(STALL_CONFIG)
    for tick in range(10 * limit):
        d.tick()
        if (reason := d.scheduler.stall()) is not None:
            break
    else:
        pytest.fail(f"no stall reported in {10 * limit} steps without a token")
    assert tick == limit and not d.outputs, "reported as soon as the limit is passed, with no token committed"
    assert "no request got a token" in reason and "preemptions meanwhile" in reason, reason
    assert d.scheduler.stats().num_preemptions >= limit - 1


def test_no_stall_reported_while_a_long_prefill_makes_progress():
    """The same two prompts under fcfs, and a prompt of `max_model_len` tokens at one token a
    step: the longest legitimate stretch without a token, never reported."""
    for config, prompt in ((STALL_CONFIG, None), (replace(STALL_CONFIG, max_num_batched_tokens=1, max_model_len=64), 63)):
        d = Driver.create(config, hashed_tokens(1000))
        if prompt is None:
            _two_long_prompts(d)
        else:
            d.scheduler.add_request(Request("long", range(1, prompt + 1), SamplingParams(max_tokens=1), 0, None))
        while d.scheduler.has_unfinished_requests() or d.results:
            d.tick()
            assert d.scheduler.stall() is None
        assert d.finished and d.scheduler.stats().num_preemptions == 0
