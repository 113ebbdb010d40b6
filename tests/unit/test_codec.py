"""Plans and results survive the trip through protobuf unchanged."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stepahead import codec, columns
from stepahead.plan import (
    GrammarPrep, GrammarReady, NewRequest, RunningRequest, SamplingParams, StepPlan, StepResult, StructuredKind,
    StructuredOutput,
)

ids = st.lists(st.integers(0, 2**31 - 1), max_size=8).map(tuple)
sampling = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    top_k=st.integers(-1, 100),
    top_p=st.sampled_from([0.25, 0.5, 1.0]),
    min_p=st.sampled_from([0.0, 0.125, 1.0]),
    seed=st.none() | st.integers(-(2**62), 2**62),
    max_tokens=st.integers(1, 4096),
    min_tokens=st.integers(0, 16),
    stop_token_ids=ids,
    ignore_eos=st.booleans(),
    logit_bias=st.dictionaries(st.integers(0, 2**31 - 1), st.sampled_from([-100.0, -0.5, 2.25]), max_size=4).map(
        lambda d: tuple(sorted(d.items()))),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.25]),
    presence_penalty=st.sampled_from([0.0, -2.0, 0.75]),
    frequency_penalty=st.sampled_from([0.0, 2.0, -0.125]),
)
ID = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1, max_size=8)  # ids never hold NUL (limits)
new_req = st.builds(
    NewRequest,
    request_id=ID,
    token_ids=ids,
    sampling=sampling,
    block_ids=ids,
    num_computed_tokens=st.integers(0, 1000),
    num_scheduled_tokens=st.integers(0, 1000),
    num_prompt_tokens=st.integers(0, 1000),
)
running = st.builds(
    RunningRequest,
    request_id=ID,
    new_block_ids=ids,
    num_scheduled_tokens=st.integers(0, 1000),
    input_is_placeholder=st.booleans(),
    num_draft_tokens=st.integers(0, 16),
)
pairs = st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), max_size=4).map(tuple)
gate = st.lists(st.integers(0, 2**31 - 1), max_size=3).map(tuple)
structured = (st.builds(StructuredOutput, st.sampled_from([StructuredKind.JSON_SCHEMA, StructuredKind.REGEX,
                                                           StructuredKind.GRAMMAR]), st.text(max_size=8),
                        start_after=gate)
              | st.builds(StructuredOutput, st.just(StructuredKind.JSON_OBJECT), start_after=gate)
              | st.builds(StructuredOutput, st.just(StructuredKind.CHOICE),
                          choices=st.lists(st.text(max_size=4), min_size=1, max_size=3).map(tuple), start_after=gate))
grammars = st.lists(st.builds(GrammarPrep, ID, structured), max_size=2).map(tuple)
plans = st.builds(
    StepPlan,
    step_id=st.integers(0, 2**40),
    new_requests=st.lists(new_req, max_size=3).map(tuple),
    running=st.lists(running, max_size=6).map(tuple),
    finished_ids=st.lists(st.text(max_size=4), max_size=3).map(tuple),
    preempted_ids=st.lists(st.text(max_size=4), max_size=3).map(tuple),
    swap_out=pairs,
    swap_in=pairs,
    grammars=grammars,
)


@given(plans)
def test_plan_round_trip(plan: StepPlan) -> None:
    wire = codec.plan_to_proto(plan).SerializeToString()
    from stepahead.v1 import scheduler_pb2

    back = codec.plan_from_proto(scheduler_pb2.StepPlan.FromString(wire))
    assert back == plan


@given(st.integers(0, 2**40), st.dictionaries(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=6),
                                              st.integers(0, 2**32 - 1)))
def test_result_round_trip(step_id: int, sampled: dict[str, int]) -> None:
    result = StepResult(step_id=step_id, sampled_token_ids=sampled)
    assert codec.result_from_proto(codec.result_to_proto(result)) == result


def test_worker_timing_with_device_busy_time_round_trips():
    from stepahead.plan import WorkerTiming

    timing = WorkerTiming(1.0, 2.0, 3.0, 4.0, 5.0, device_busy_s=0.0123)
    result = StepResult(7, {"a": 3}, timing)
    back = codec.result_from_proto(codec.result_to_proto(result))
    assert back == result and back.timing.device_busy_s == 0.0123


def test_event_batches_carry_every_field_and_cut_the_scope():
    from scheduler_service.core.events import RequestEvent
    from scheduler_service.event_batches import event_batches
    from stepahead.plan import FinishReason
    from stepahead.v1 import common_pb2

    events = [RequestEvent("3/a", (7, 8), None, 12, 0),
              RequestEvent("3/b", (9,), FinishReason.LENGTH, 5, 4),
              RequestEvent("3/c", (), FinishReason.ERROR, 6, 0, message="row failed")]
    (batch,) = event_batches(events, scope_len=2)
    out = batch.events
    assert not batch.token_request_ids, "none of them is plain (a first event, a finish, an error)"
    assert [(e.request_id, list(e.token_ids), e.num_prompt_tokens, e.num_cached_tokens, e.message) for e in out] == [
        ("a", [7, 8], 12, 0, ""), ("b", [9], 5, 4, ""), ("c", [], 6, 0, "row failed")]
    assert [e.finish_reason for e in out] == [common_pb2.FINISH_REASON_UNSPECIFIED, common_pb2.FINISH_REASON_LENGTH,
                                              common_pb2.FINISH_REASON_ERROR]


_PACK = {"request_ids": columns.pack_ids, "num_scheduled_tokens": columns.pack_u32,
         "input_is_placeholder": columns.pack_flags, "num_draft_tokens": columns.pack_u32,
         "num_new_blocks": columns.pack_u32, "new_block_ids": list}


def _decode_plan(**running):
    from stepahead.v1 import scheduler_pb2

    packed = {k: _PACK[k](v) for k, v in running.items()}
    return codec.plan_from_proto(scheduler_pb2.StepPlan(step_id=1, running=scheduler_pb2.RunningDeltas(**packed)))


def test_a_grammar_to_prepare_without_a_constraint_is_refused_by_name():
    import pytest

    from stepahead.v1 import common_pb2, scheduler_pb2

    for empty in (common_pb2.StructuredOutputs(), common_pb2.StructuredOutputs(json_object=False)):
        msg = scheduler_pb2.StepPlan(step_id=1, grammars=[scheduler_pb2.GrammarPrep(request_id="r", structured=empty)])
        with pytest.raises(ValueError, match=r"grammars: request 'r' has no constraint"):
            codec.plan_from_proto(msg)


@given(ID, st.text(max_size=20), st.booleans())
def test_grammar_ready_round_trip(request_id: str, error: str, invalid: bool) -> None:
    ready = GrammarReady(request_id, error, invalid)
    assert codec.grammar_ready_from_proto(codec.grammar_ready_to_proto(ready)) == ready


def test_running_columns_that_do_not_line_up_are_refused_by_name():
    import pytest

    good = dict(request_ids=["a", "b"], num_scheduled_tokens=[1, 1], input_is_placeholder=[True, False],
                num_draft_tokens=[0, 0], num_new_blocks=[0, 2], new_block_ids=[4, 5])
    assert _decode_plan(**good).running == (RunningRequest("a", (), 1, True), RunningRequest("b", (4, 5), 1, False))
    for column in ("num_scheduled_tokens", "input_is_placeholder", "num_draft_tokens", "num_new_blocks"):
        with pytest.raises(ValueError, match=rf"StepPlan\.running\.{column}: 1 entries for 2 request_ids"):
            _decode_plan(**{**good, column: good[column][:1]})
    for blocks in ([], [4], [4, 5, 6]):
        with pytest.raises(ValueError, match=r"StepPlan\.running\.new_block_ids"):
            _decode_plan(**{**good, "new_block_ids": blocks})


def test_sampled_columns_that_do_not_line_up_are_refused_by_name():
    import pytest

    from stepahead.v1 import scheduler_pb2

    def result(ids, tokens):
        return scheduler_pb2.StepResult(step_id=3, sampled_request_ids=columns.pack_ids(ids),
                                        sampled_token_ids=columns.pack_u32(tokens))

    assert codec.result_from_proto(result(["a", "b"], [7, 8])).sampled_token_ids == {"a": 7, "b": 8}
    with pytest.raises(ValueError, match=r"StepResult\.sampled_token_ids: 1 tokens for 2 sampled_request_ids"):
        codec.result_from_proto(result(["a", "b"], [7]))
    twice = codec.result_from_proto(result(["a", "a"], [7, 8]))
    with pytest.raises(ValueError, match=r"StepResult\.sampled_request_ids: a request id appears more than once"):
        twice.sampled_token_ids.keys()  # ids are parsed when first read


@given(st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=5), max_size=20),
       st.lists(st.integers(0, 2**32 - 1), max_size=20), st.lists(st.booleans(), max_size=20))
def test_packed_columns_round_trip(ids, ints, flags):
    assert columns.unpack_ids(columns.pack_ids(ids), "f") == ids
    assert columns.unpack_u32(columns.pack_u32(ints), "f") == ints
    assert columns.unpack_flags(columns.pack_flags(flags), "f") == flags


def test_malformed_packed_columns_are_refused_by_name():
    import pytest

    for bad, match in ((b"a\0b", "not NUL-terminated"), (b"\xff\0", "not UTF-8")):
        with pytest.raises(ValueError, match=f"^ids: .*{match}"):
            columns.unpack_ids(bad, "ids")
    with pytest.raises(ValueError, match="toks: 5 bytes is not a whole number of uint32"):
        columns.unpack_u32(b"12345", "toks")
    with pytest.raises(ValueError, match="flags: a flag byte other than 0 or 1"):
        columns.unpack_flags(b"\0\2", "flags")
    with pytest.raises(ValueError, match="contains a NUL"):
        columns.pack_ids(["a\0b"])
    with pytest.raises(ValueError, match="outside"):
        columns.pack_u32([2**32])
