"""Logprobs in the gateway: aligned with the returned text, cut with stop strings, prompt
logprobs deduplicated by position, OpenAI request mapping and failover continuation."""

from __future__ import annotations

import pytest

from gateway.event_stream import EventMerger, Mailbox
from gateway.logprob_output import PromptLogprobsCollector, TokenText
from gateway.openai_format import CompletionFormat
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, chat_to_raw, completion_to_raw, openai_param
from gateway.scheduler_pool import continuation
from stepahead import codec
from stepahead.logprobs import Logprobs
from stepahead.v1 import common_pb2, scheduler_pb2
from tests.unit.test_gateway_frontend import CharTokenizer, FakeLink, event, frontend


def lp(token: int, value: float = -1.0, top=()) -> common_pb2.Logprobs:
    return codec.logprobs_to_proto(Logprobs(token, value, tuple(top)))


def start(body: dict, link=None):
    front = frontend(link or FakeLink())
    valid = front.validate(completion_to_raw(CompletionRequest.model_validate(body), 10))
    return front.start(valid, "r", lambda _: None, "http")


def test_held_back_text_holds_its_logprobs_and_a_stop_string_cuts_them():
    gen = start({"prompt": "hi", "logprobs": 1, "stop": "CD", "max_tokens": 9})
    first = gen.on_event(event("r", [0, 2], logprobs=[lp(0, -0.5, [(7, -0.125)]), lp(2)])).output  # "AC": C held
    assert first.text == "A" and [e.token for e in first.logprobs] == ["A"]
    assert first.logprobs[0].top == ((7, "H", -0.125, b"H"),)
    second = gen.on_event(event("r", [3, 4], logprobs=[lp(3), lp(4)])).output  # "DE": "CD" matched
    assert second.finished and second.text == "" and second.logprobs == ()  # C, D, E start past "A"
    gen2 = start({"prompt": "hi", "logprobs": 0, "stop": "CD", "max_tokens": 9})
    gen2.on_event(event("r", [0, 2], logprobs=[lp(0), lp(2)]))
    out = gen2.on_event(event("r", [5], logprobs=[lp(5)])).output  # "CF": the held C goes out with F
    assert out.text == "CF" and [(e.token, e.offset) for e in out.logprobs] == [("C", 1), ("F", 2)]


def test_completion_format_with_echo_puts_the_prompt_first():
    gen = start({"prompt": [1, 2, 3], "logprobs": 2, "echo": True, "max_tokens": 1})
    fmt = CompletionFormat("id", "m", 1, ["BCD"], logprobs=True)
    prompt_part = dict(prompt_logprobs=[lp(2, -2.0), lp(3, -3.0)], prompt_logprobs_start=1)
    fmt.accumulate(gen.on_event(event("r", [4], common_pb2.FINISH_REASON_LENGTH, logprobs=[lp(4, -0.25)],
                                      **prompt_part)))
    body = fmt.full()["choices"][0]
    assert body["text"] == "BCDE"
    assert body["logprobs"] == {"tokens": ["B", "C", "D", "E"], "token_logprobs": [None, -2.0, -3.0, -0.25],
                                "top_logprobs": [None, {"C": -2.0}, {"D": -3.0}, {"E": -0.25}],
                                "text_offset": [0, 1, 2, 3]}


def test_prompt_logprobs_are_kept_by_position_and_sent_once():
    collector = PromptLogprobsCollector([5, 6, 7], TokenText(CharTokenizer()), lambda ids: ["x"] * len(ids))
    collector.add(1, [Logprobs(6, -1.0)])
    assert collector.take() is None
    collector.add(1, [Logprobs(6, -9.0), Logprobs(7, -2.0)])  # resubmitted: position 1 again
    entries = collector.take()
    assert [e.logprob for e in entries] == [None, -1.0, -2.0] and collector.take() is None
    with pytest.raises(ValueError):
        collector.add(2, [Logprobs(5, -1.0)])  # not the prompt's token at position 2


def test_event_merging_keeps_logprobs_aligned_and_prompt_parts_apart():
    import asyncio

    async def run():
        q = Mailbox()
        for e in (event("r", [1], logprobs=[lp(1)]), event("r", [2], logprobs=[lp(2)]),
                  event("r", [3], logprobs=[lp(3)], prompt_logprobs=[lp(9)], prompt_logprobs_start=1)):
            q.put_nowait(e)
        merger = EventMerger(q)
        return await merger.next(), await merger.next()

    merged, rest = asyncio.run(run())
    assert list(merged.token_ids) == [1, 2] and [e.token_id for e in merged.logprobs] == [1, 2]
    assert list(rest.prompt_logprobs)


def test_openai_logprobs_parameters_map_to_sampling():
    raw = completion_to_raw(CompletionRequest(prompt="x", logprobs=0, echo=True), 10)
    assert (raw.sampling.logprobs, raw.sampling.prompt_logprobs) == (0, 0)  # logprobs=0: the sampled token only (vLLM #3707)
    assert completion_to_raw(CompletionRequest(prompt="x", logprobs=2), 10).sampling.prompt_logprobs is None
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert chat_to_raw(chat, 10).sampling.logprobs == 0  # logprobs without top_logprobs is legal (vLLM #4795)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat_to_raw(chat, 10).sampling.logprobs is None
    assert openai_param("sampling.logprobs", chat=True) == "top_logprobs"
    assert openai_param("sampling.prompt_logprobs", chat=False) == "logprobs"
    with pytest.raises(Exception) as info:
        start({"prompt": "x", "logprobs": 21})
    assert info.value.field == "sampling.logprobs"


def test_failover_continuation_asks_prompt_logprobs_only_before_any_token():
    msg = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1, 2],
                                      sampling=common_pb2.SamplingParams(max_tokens=5, logprobs=1, prompt_logprobs=1))
    assert continuation(msg, []).sampling.HasField("prompt_logprobs")
    again = continuation(msg, [7])
    assert not again.sampling.HasField("prompt_logprobs") and again.sampling.logprobs == 1


def test_the_token_that_stops_a_request_is_in_its_ids_but_not_its_text_unless_asked():
    """vLLM's rule for the token the scheduler stops on (EOS or a stop token id): like a stop
    string, it is kept out of the text unless `include_stop_str_in_output`; its id stays in the
    token ids (and is the stop_reason), and its logprob entry has an empty piece."""
    body = {"prompt": "hi", "logprobs": 0, "stop_token_ids": [5], "max_tokens": 9}
    tail = event("r", [1, 5], common_pb2.FINISH_REASON_STOP, logprobs=[lp(1), lp(5)])
    gen = start(body)
    first = gen.on_event(event("r", [0], logprobs=[lp(0)])).output
    last = gen.on_event(tail).output
    assert (first.text, last.text, last.token_ids, last.stop_reason) == ("A", "B", (1, 5), "5")
    assert [(e.token, e.offset) for e in (*first.logprobs, *last.logprobs)] == [("A", 0), ("B", 1), ("", 2)]
    kept = start({**body, "include_stop_str_in_output": True}).on_event(tail).output
    assert kept.text == "BF" and [e.token for e in kept.logprobs] == ["B", "F"]
    alone = start(body).on_event(event("r", [5], common_pb2.FINISH_REASON_STOP, logprobs=[lp(5)])).output
    assert alone.text == "" and alone.token_ids == (5,) and [e.token for e in alone.logprobs] == [""]
    cut = start(body).on_event(event("r", [1, 5], common_pb2.FINISH_REASON_LENGTH, logprobs=[lp(1), lp(5)])).output
    assert cut.text == "BF", "a request cut at max_tokens returns its last token"
