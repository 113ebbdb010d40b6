"""The core's plain tokens: a running request's plain decode (not its first token, not its
last, nothing else asked) comes out of `update_from_output` in the step's `PlainTokens`
columns (read as a `PlainTokenEvent`), every other event as a `RequestEvent`, and a plain
token reads exactly like the `RequestEvent` it stands for (but for its request's counts,
which the gateway has from the request's first event)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.events import PlainTokenEvent, PlainTokens, RequestEvent, split_plain
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from stepahead.logprobs import Logprobs
from stepahead.plan import SamplingParams, StepResult
from tests.unit.fake_executor import Driver, RequestSpec, eos_at, hashed_tokens, run_alone

TOKENS = hashed_tokens(vocab_size=1000)
CONFIG = SchedulerConfig(num_gpu_blocks=64, max_model_len=64, block_size=4, max_num_batched_tokens=24,
                         eos_token_ids=(0,), async_scheduling=True)


def specs() -> list[RequestSpec]:
    shared = tuple(range(1, 9))  # two blocks: the later requests hit the prefix cache
    return [
        RequestSpec("long", shared + (20, 21), SamplingParams(temperature=0.0, max_tokens=12)),
        RequestSpec("eos", shared + (30,), SamplingParams(temperature=0.0, max_tokens=20)),
        RequestSpec("one", (40, 41, 42), SamplingParams(temperature=0.0, max_tokens=1)),
        RequestSpec("two", shared + (50, 51, 52), SamplingParams(temperature=0.0, max_tokens=2)),
        RequestSpec("minimum", (60, 61), SamplingParams(temperature=0.0, max_tokens=9, min_tokens=5)),
    ]


def run(config: SchedulerConfig) -> Driver:
    token_fn = eos_at(0, {"eos": 6, "minimum": 2}, TOKENS)
    d = Driver.create(config, token_fn)
    first, *later = specs()
    d.scheduler.add_request(first.build())
    while not d.outputs.get(first.request_id):  # its prompt's blocks are cached from here on
        d.tick()
    for spec in later:
        d.scheduler.add_request(spec.build())
    d.run_until_done()
    for spec in specs():
        assert (d.outputs[spec.request_id], d.finished[spec.request_id]) == run_alone(config, spec, token_fn)
    return d


def test_only_a_requests_middle_tokens_are_plain():
    for config in (CONFIG, replace(CONFIG, async_scheduling=False), replace(CONFIG, max_concurrent_batches=3)):
        d = run(config)
        for spec in specs():
            events = [e for e in d.events if e.request_id == spec.request_id]
            first, *middle, last = events if len(events) > 1 else (events[0], events[0])
            assert type(first) is RequestEvent and first.queue_time is not None, spec.request_id
            assert type(last) is RequestEvent and last.finish_reason is not None, spec.request_id
            assert all(type(e) is PlainTokenEvent for e in middle), (spec.request_id, middle)
        plain = [e for e in d.events if type(e) is PlainTokenEvent]
        assert len(plain) >= 10, "the workload's long requests must decode plain tokens"


def test_a_plain_event_reads_as_the_request_event_it_stands_for():
    event = PlainTokenEvent("r", 7)
    same = RequestEvent("r", (7,), None, 12, 8)
    for f in dataclasses.fields(RequestEvent):  # a field added to RequestEvent must be readable here
        if f.name not in ("num_prompt_tokens", "num_cached_tokens"):  # the request's, from its first event
            assert getattr(event, f.name) == getattr(same, f.name), f.name


def test_logprobs_make_a_full_event_for_their_request_only():
    """In a step where one request asked for logprobs, only its event is a RequestEvent (it
    carries them); the others' decodes stay plain."""
    sched = Scheduler(replace(CONFIG, async_scheduling=False))
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)))
    sched.add_request(Request("b", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=6)))
    kinds = []
    for step in range(4):
        plan = sched.schedule()
        result = StepResult(plan.step_id, {"a": 7 + step, "b": 9 + step}, logprobs={"a": Logprobs(7 + step, -1.0)})
        kinds.append({e.request_id: type(e) for e in sched.update_from_output(plan, result)})
    assert kinds[0] == {"a": RequestEvent, "b": RequestEvent}, "first tokens are full events"
    assert kinds[1:] == [{"a": RequestEvent, "b": PlainTokenEvent}] * 3


@given(st.lists(st.tuples(st.sampled_from([None, *range(12)]), st.integers(0, 2**32 - 1)), max_size=80))
@settings(max_examples=300, deadline=None)
def test_split_plain_gives_each_sink_its_tokens_in_order(rows):
    """One share per sink that listens, in the order the sinks first appear, holding exactly that
    sink's tokens in step order, whether the step has one sink or many; nobody's (None) tokens go
    nowhere."""
    plain = PlainTokens()
    sink_of = {}
    for i, (sink, token) in enumerate(rows):
        plain.add(f"r{i}", token)
        sink_of[f"r{i}"] = sink
    shares = split_plain(plain, sink_of.get)
    expected: dict = {}
    for i, (sink, token) in enumerate(rows):
        if sink is not None:
            expected.setdefault(sink, ([], []))
            expected[sink][0].append(f"r{i}")
            expected[sink][1].append(token)
    assert [sink for sink, _ in shares] == list(expected)
    for sink, share in shares:
        assert (share.request_ids, share.token_ids) == expected[sink]
