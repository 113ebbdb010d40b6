"""Scheduler unit tests: chunked prefill, prefix hits, stop conditions, async placeholders,
stale results, fences on abort, preemption (recompute and swap), priority preemption."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler_service.core.config import PreemptionMode, SchedulerConfig, SchedulingPolicy
from scheduler_service.core.request import FinishReason, Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from stepahead.plan import SamplingParams, StepResult
from tests.unit.fake_executor import Driver, RequestSpec, eos_at, hashed_tokens, run_alone

TOKENS = hashed_tokens(vocab_size=1000)  # EOS (0) is rare: tests place it with eos_at
BASE = SchedulerConfig(num_gpu_blocks=32, max_model_len=64, block_size=4, max_num_batched_tokens=64,
                       eos_token_ids=(0,))


def greedy(max_tokens=4, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def driver(config=BASE, token_fn=TOKENS, **kw) -> Driver:
    return Driver.create(config, token_fn, **kw)


def test_chunked_prefill_samples_only_after_the_last_chunk():
    d = driver(replace(BASE, max_num_batched_tokens=4, async_scheduling=False))
    d.scheduler.add_request(Request("a", range(1, 11), greedy(2)))
    chunks = []
    for _ in range(3):
        assert d.step()
        plan = d.plans[-1]
        chunks.append(plan.num_scheduled_tokens)
        events = d.deliver()
        assert len(events) == (1 if len(chunks) == 3 else 0)
    assert chunks == [4, 4, 2]
    assert len(d.plans[0].new_requests) == 1 and len(d.plans[1].running) == 1
    d.run_until_done()
    assert d.outputs["a"] == run_alone(BASE, RequestSpec("a", tuple(range(1, 11)), greedy(2)), TOKENS)[0]


def test_long_prefill_threshold_caps_each_request_per_step():
    d = driver(replace(BASE, long_prefill_token_threshold=3, async_scheduling=False))
    d.scheduler.add_request(Request("a", range(1, 8), greedy(1)))
    d.scheduler.add_request(Request("b", [5], greedy(1)))
    assert d.step()
    assert {r.request_id: r.num_scheduled_tokens for r in d.plans[0].new_requests} == {"a": 3, "b": 1}


def test_prefix_hit_skips_cached_blocks_and_is_reported():
    d = driver()
    prompt = list(range(1, 12))  # 11 tokens: two full blocks can be shared
    d.scheduler.add_request(Request("a", prompt, greedy(2)))
    d.run_until_done()
    d.scheduler.add_request(Request("b", prompt[:9] + [99, 98], greedy(2)))
    assert d.step()
    [new] = d.plans[-1].new_requests
    assert new.num_computed_tokens == 8 and new.num_scheduled_tokens == 3
    d.run_until_done()
    assert d.events[-1].num_cached_tokens == 8
    stats = d.scheduler.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (22, 8)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_blocks_filled_by_decoding_are_cached_for_the_next_turn(async_scheduling):
    """A conversation's next turn (the prompt, the answer, a new message) reuses the blocks the
    answer filled while it was decoded, not only the prompt's: each filled block is registered
    as the decode commits it (`register_filled`)."""
    d = driver(replace(BASE, async_scheduling=async_scheduling))
    prompt = list(range(1, 7))  # 6 tokens: one full block from the prefill
    d.scheduler.add_request(Request("a", prompt, greedy(12)))
    d.run_until_done()
    answer = d.outputs["a"]
    assert len(answer) == 12  # 18 tokens known, 17 with their KV computed: 4 full blocks
    d.scheduler.add_request(Request("b", prompt + answer + [999], greedy(2)))
    assert d.step()
    [new] = d.plans[-1].new_requests
    assert new.num_computed_tokens == 16  # block 0 from the prompt, blocks 1-3 filled by decoding
    d.run_until_done()
    assert d.outputs["b"] == run_alone(BASE, RequestSpec("b", tuple(prompt + answer + [999]), greedy(2)), TOKENS)[0]


@pytest.mark.parametrize(
    ("sampling", "eos_len", "want_len", "reason"),
    [
        (greedy(8), 5, 2, FinishReason.STOP),  # prompt 3 + 2 outputs: EOS is the 2nd output
        (greedy(8, min_tokens=3), 5, 8, FinishReason.LENGTH),  # EOS before min_tokens is ignored
        (greedy(8, ignore_eos=True), 5, 8, FinishReason.LENGTH),
        (greedy(3), None, 3, FinishReason.LENGTH),
    ],
)
def test_stop_conditions(sampling, eos_len, want_len, reason):
    token_fn = eos_at(0, {"a": eos_len} if eos_len else {}, TOKENS)
    d = driver(token_fn=token_fn)
    d.scheduler.add_request(Request("a", [1, 2, 3], sampling))
    d.run_until_done()
    assert len(d.outputs["a"]) == want_len and d.finished["a"] is reason


def test_stop_token_ids_and_max_model_len():
    stop_fn = eos_at(77, {"a": 6}, TOKENS)
    d = driver(token_fn=stop_fn)
    d.scheduler.add_request(Request("a", [1, 2, 3], greedy(10, stop_token_ids=(77,))))
    d.run_until_done()
    assert d.outputs["a"][-1] == 77 and len(d.outputs["a"]) == 3 and d.finished["a"] is FinishReason.STOP
    short = driver(replace(BASE, max_model_len=6))
    short.scheduler.add_request(Request("b", [1, 2, 3], greedy(10)))
    short.run_until_done()
    assert len(short.outputs["b"]) == 3 and short.finished["b"] is FinishReason.LENGTH


def test_async_decode_uses_a_placeholder_and_never_passes_max_tokens():
    d = driver()
    d.scheduler.add_request(Request("a", [1, 2, 3], greedy(3)))
    assert d.step() and d.step() and not d.step()  # window of two plans is full
    second = d.plans[1].running[0]
    assert second.input_is_placeholder and second.num_scheduled_tokens == 1
    assert d.scheduler.get_request("a").num_output_placeholders == 2
    d.deliver()
    assert d.step()  # third and last token
    d.deliver()
    assert d.scheduler.schedule() is None  # 1 committed + 2 placeholders = max_tokens
    d.run_until_done()
    assert len(d.plans) == 3 and len(d.outputs["a"]) == 3


def test_eos_in_flight_makes_the_next_result_stale():
    token_fn = eos_at(0, {"a": 4}, TOKENS)  # the first output is EOS
    d = driver(token_fn=token_fn)
    d.scheduler.add_request(Request("a", [1, 2, 3], greedy(5)))
    assert d.step() and d.step()
    events = d.deliver()
    assert events[0].finish_reason is FinishReason.STOP and d.outputs["a"] == [0]
    assert d.scheduler.stats().num_fenced_blocks > 0  # the in-flight step still touches them
    assert d.deliver() == [] and d.num_stale == 1
    assert d.scheduler.stats().num_fenced_blocks == 0
    assert d.step() is False  # nothing left; the finished id waits for the next plan
    d.scheduler.add_request(Request("b", [4], greedy(1)))
    assert d.step() and d.plans[-1].finished_ids == ("a",)


def test_abort_with_a_step_in_flight_fences_until_its_result():
    d = driver()
    d.scheduler.add_request(Request("a", [1, 2, 3, 4, 5], greedy(5)))
    assert d.step()
    event = d.abort("a")
    assert event.finish_reason is FinishReason.ABORT
    stats = d.scheduler.stats()
    assert stats.num_fenced_blocks == 2 and stats.num_free_blocks == BASE.num_gpu_blocks - 2
    d.scheduler.check_integrity()
    assert d.deliver() == [] and d.scheduler.stats().num_free_blocks == BASE.num_gpu_blocks
    assert d.abort("a") is None  # finished ids are unknown now


def _two_request_pressure(mode: PreemptionMode) -> Driver:
    # 3 blocks of 4 tokens: "a" and "b" cannot both grow to 2 blocks... and 1 more
    config = replace(BASE, num_gpu_blocks=3, num_cpu_blocks=4, max_model_len=12, preemption_mode=mode,
                     async_scheduling=False)
    d = driver(config)
    d.scheduler.add_request(Request("a", [1, 2, 3], greedy(8)))
    d.scheduler.add_request(Request("b", [4, 5, 6], greedy(8)))
    return d


@pytest.mark.parametrize("mode", list(PreemptionMode))
def test_preemption_resumes_consistently(mode):
    d = _two_request_pressure(mode)
    d.run_until_done()
    stats = d.scheduler.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_outs > 0) is (mode is PreemptionMode.SWAP)
    preempted = [p for p in d.plans if p.preempted_ids]
    assert preempted and all(p.swap_out for p in preempted) is (mode is PreemptionMode.SWAP)
    resumed = [nr for p in d.plans for nr in p.new_requests if nr.request_id == preempted[0].preempted_ids[0]]
    assert len(resumed) == 2 and len(resumed[1].token_ids) > 3  # prompt + committed output
    if mode is PreemptionMode.SWAP:
        assert resumed[1].num_computed_tokens > 0 and any(p.swap_in for p in d.plans)
    for rid, prompt in (("a", (1, 2, 3)), ("b", (4, 5, 6))):
        want = run_alone(d.scheduler.config, RequestSpec(rid, prompt, greedy(8)), TOKENS)
        assert (d.outputs[rid], d.finished[rid]) == want


def test_preempted_while_in_flight_drops_the_stale_token():
    config = replace(BASE, num_gpu_blocks=3, max_model_len=12)
    d = driver(config)
    d.scheduler.add_request(Request("a", [1, 2, 3], greedy(8)))
    d.scheduler.add_request(Request("b", [4, 5, 6], greedy(8)))
    while not any(p.preempted_ids for p in d.plans):
        d.tick()
        d.scheduler.check_integrity()
    d.run_until_done()
    assert d.num_stale > 0
    for rid, prompt in (("a", (1, 2, 3)), ("b", (4, 5, 6))):
        assert d.outputs[rid] == run_alone(config, RequestSpec(rid, prompt, greedy(8)), TOKENS)[0]


def test_priority_preempts_worse_running_work():
    config = replace(BASE, num_gpu_blocks=2, max_model_len=8, scheduling_policy=SchedulingPolicy.PRIORITY,
                     async_scheduling=False)
    d = driver(config)
    d.scheduler.add_request(Request("low", [1, 2, 3, 4, 5], greedy(3), priority=5))
    d.tick()
    d.scheduler.add_request(Request("high", [6, 7, 8, 9, 10], greedy(3), priority=0))
    assert d.step()
    assert d.plans[-1].preempted_ids == ("low",) and d.plans[-1].new_requests[0].request_id == "high"
    assert d.scheduler.get_request("low").status is RequestStatus.PREEMPTED
    d.run_until_done()
    assert d.finished == {"high": FinishReason.LENGTH, "low": FinishReason.LENGTH}


def test_fcfs_never_preempts_for_a_waiting_request():
    config = replace(BASE, num_gpu_blocks=2, max_model_len=8, async_scheduling=False)
    d = driver(config)
    d.scheduler.add_request(Request("low", [1, 2, 3, 4, 5], greedy(3), priority=5))
    d.tick()
    d.scheduler.add_request(Request("high", [6, 7, 8, 9, 10], greedy(3), priority=0))
    assert d.step() and not d.plans[-1].preempted_ids and not d.plans[-1].new_requests


def test_sync_mode_keeps_one_plan_in_flight():
    d = driver(replace(BASE, async_scheduling=False))
    d.scheduler.add_request(Request("a", [1, 2], greedy(4)))
    assert d.step() and not d.scheduler.can_schedule() and d.scheduler.schedule() is None
    d.deliver()
    assert d.step() and not d.plans[-1].running[0].input_is_placeholder


def test_update_from_output_rejects_out_of_order_or_incomplete_results():
    sched = Scheduler(BASE)
    sched.add_request(Request("a", [1, 2], greedy(4)))
    first, second = sched.schedule(), sched.schedule()
    with pytest.raises(ValueError, match="not the oldest"):
        sched.update_from_output(second, StepResult(second.step_id, {"a": 1}))
    with pytest.raises(ValueError, match="lacks sampled tokens"):
        sched.update_from_output(first, StepResult(first.step_id, {}))
    with pytest.raises(ValueError, match="did not sample"):
        sched.update_from_output(first, StepResult(first.step_id, {"a": 1, "zzz": 2}))
    sched.check_integrity()  # rejected results changed nothing
    assert list(sched.update_from_output(first, StepResult(first.step_id, {"a": 1})))[0].new_token_ids == (1,)


@pytest.mark.parametrize("collide", [False, True], ids=["real-hash", "all-hashes-collide"])
def test_shared_prefixes_end_to_end_even_when_every_hash_collides(collide):
    kwargs = {"hash_fn": lambda parent, tokens, salt: 0} if collide else {}
    config = replace(BASE, num_gpu_blocks=12, max_model_len=24, block_size=2)
    d = driver(config, **kwargs)
    specs = [
        RequestSpec(f"r{i}", prefix + suffix, greedy(4), cache_salt=salt)
        for i, (prefix, suffix, salt) in enumerate(
            [((1, 2, 3, 4), (5,), None), ((1, 2, 3, 4), (6, 7), None), ((3, 4, 1, 2), (5,), None),
             ((1, 2, 3, 4), (5,), "other"), ((1, 2, 9, 4), (5, 6), None), ((1, 2, 3, 4), (5, 8), None)]
        )
    ]
    for spec in specs[:2]:
        d.scheduler.add_request(spec.build())
    d.run_until_done()
    for spec in specs[2:]:
        d.scheduler.add_request(spec.build())
    d.run_until_done()
    assert d.scheduler.stats().prefix_hit_tokens >= 8  # r1 and r5 reuse (1, 2) (3, 4) at least
    for spec in specs:
        assert (d.outputs[spec.request_id], d.finished[spec.request_id]) == run_alone(config, spec, TOKENS)
