"""Grammars prepared beside the steps (`SchedulerConfig.prepare_grammars`, the worker's hello):
a structured request waits PREPARING until its worker reports the grammar, and no plan
sends it before. The fake worker ignores a plan's `grammars`; the tests report them."""

from __future__ import annotations

from dataclasses import replace

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import FinishReason, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from stepahead.plan import GrammarReady, SamplingParams, StructuredKind, StructuredOutput
from tests.unit.fake_executor import Driver, RequestSpec, hashed_tokens, run_alone

TOKENS = hashed_tokens(vocab_size=1000)
CONFIG = SchedulerConfig(num_gpu_blocks=32, max_model_len=64, block_size=4, max_num_batched_tokens=64,
                         eos_token_ids=(0,), prepare_grammars=True)
SOLO = replace(CONFIG, prepare_grammars=False)  # the oracle's core: nobody reports grammars to it
CHOICE = StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no"))
STRUCTURED = RequestSpec("s", tuple(range(1, 10)), SamplingParams(temperature=0.0, max_tokens=5, structured=CHOICE))
PLAIN = RequestSpec("p", tuple(range(20, 31)), SamplingParams(temperature=0.0, max_tokens=6))


def new_ids(d: Driver) -> list[str]:
    return [r.request_id for p in d.plans for r in p.new_requests]


def ordered(d: Driver) -> list[str]:
    return [g.request_id for p in d.plans for g in p.grammars]


def test_a_structured_request_runs_only_after_its_grammar_is_reported():
    d = Driver.create(CONFIG, TOKENS)
    d.scheduler.add_request(STRUCTURED.build())
    d.scheduler.add_request(PLAIN.build())
    while "p" not in d.finished:
        d.tick()
        d.scheduler.check_integrity()
    assert not d.step()  # nothing else can run
    assert ordered(d) == ["s"] and d.plans[0].grammars[0].structured == CHOICE
    assert new_ids(d) == ["p"]  # the plain request does not wait for it
    assert d.scheduler.get_request("s").status is RequestStatus.PREPARING
    assert d.scheduler.num_preparing == 1 and d.scheduler.queue_lengths()[1] == 1  # counted as waiting
    assert d.scheduler.grammar_ready(GrammarReady("s")) is None
    d.run_until_done()
    assert new_ids(d) == ["p", "s"] and ordered(d) == ["s"]
    for spec in (STRUCTURED, PLAIN):  # as if each had run alone
        assert (d.outputs[spec.request_id], d.finished[spec.request_id]) == run_alone(SOLO, spec, TOKENS)


def test_without_the_worker_preparing_grammars_a_structured_request_queues_at_once():
    d = Driver.create(replace(CONFIG, prepare_grammars=False), TOKENS)
    d.scheduler.add_request(STRUCTURED.build())
    d.run_until_done()
    assert new_ids(d) == ["s"] and ordered(d) == []


def test_a_refused_grammar_fails_its_request_with_the_workers_reason():
    d = Driver.create(CONFIG, TOKENS)
    for rid in ("bad", "broken"):
        d.scheduler.add_request(replace(STRUCTURED, request_id=rid).build())
    d.tick()
    bad = d.scheduler.grammar_ready(GrammarReady("bad", "structured_outputs.choice: does not compile: x", invalid=True))
    broken = d.scheduler.grammar_ready(GrammarReady("broken", "structured outputs need xgrammar on the worker"))
    d.scheduler.check_integrity()
    assert (bad.finish_reason, bad.rejected, bad.new_token_ids) == (FinishReason.ERROR, True, ())
    assert bad.message == "worker: structured_outputs.choice: does not compile: x"
    assert (broken.finish_reason, broken.rejected) == (FinishReason.ERROR, False)  # a server error, not the client's
    assert not d.scheduler.has_unfinished_requests()
    d.run_until_done()
    assert new_ids(d) == []


def test_an_abort_while_preparing_ends_it_and_a_late_report_is_dropped():
    d = Driver.create(CONFIG, TOKENS)
    d.scheduler.add_request(STRUCTURED.build())
    aborted_unordered = d.scheduler.abort("s")  # before any plan ordered its grammar
    assert aborted_unordered.finish_reason is FinishReason.ABORT
    d.scheduler.add_request(STRUCTURED.build())
    d.tick()
    assert ordered(d) == ["s"]
    assert d.scheduler.abort("s").finish_reason is FinishReason.ABORT
    d.scheduler.check_integrity()
    assert d.scheduler.grammar_ready(GrammarReady("s")) is None  # the worker's report after the abort
    assert d.scheduler.grammar_ready(GrammarReady("never-ordered")) is None
    d.scheduler.check_integrity()
    d.run_until_done()
    assert new_ids(d) == [] and not d.scheduler.has_unfinished_requests()


def test_a_preparing_request_of_a_lost_replica_prepares_again_where_it_moves():
    lost = Driver.create(CONFIG, TOKENS)
    lost.scheduler.add_request(STRUCTURED.build())
    lost.tick()
    moved = lost.scheduler.release()
    assert [r.request_id for r in moved] == ["s"]
    other = Driver.create(CONFIG, TOKENS)
    other.scheduler.adopt(moved[0])
    other.tick()
    other.scheduler.check_integrity()
    assert ordered(other) == ["s"] and new_ids(other) == []  # its grammar is compiled on the new worker first
    other.scheduler.grammar_ready(GrammarReady("s"))
    other.run_until_done()
    assert (other.outputs["s"], other.finished["s"]) == run_alone(SOLO, STRUCTURED, TOKENS)


def test_the_queue_limit_counts_preparing_requests():
    core = Scheduler(replace(CONFIG, max_queued_requests=1))
    core.add_request(STRUCTURED.build())
    try:
        core.add_request(PLAIN.build())
    except Exception as exc:  # QueueFull
        assert "queue" in str(exc).lower(), exc
    else:
        raise AssertionError("a second request was queued past max_queued_requests=1")
