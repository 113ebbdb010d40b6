"""The gateway's shared path below both transports: request mapping, n choices, aborts."""

from __future__ import annotations

import pytest

from gateway.generation import Frontend, Rejected, derived_seed
from gateway.metrics import GatewayMetrics
from gateway.openai_format import ChatFormat, CompletionFormat
from gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest, chat_to_raw, completion_prompts,
                                     completion_to_raw, openai_param)
from gateway.validation import ValidationError
from stepahead.v1 import common_pb2, scheduler_pb2
from stepahead import codec


class FakeLink:
    """Records what the frontend sends; refuses ids listed in `in_flight`."""

    def __init__(self, in_flight=()):
        self.in_flight = set(in_flight)
        self.submitted, self.aborted, self.released = [], [], []

    def submit(self, msg, sink):
        if msg.request_id in self.in_flight:
            raise ValueError("already in flight")
        self.submitted.append(msg)

    def abort(self, rid):
        self.aborted.append(rid)

    def release(self, rid):
        self.released.append(rid)


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)

    def token_bytes(self, token_id):
        return self.decode([token_id]).encode()

    def __len__(self):
        return 100


def frontend(link) -> Frontend:
    hello = scheduler_pb2.WorkerHello(model_name="m", max_model_len=64, vocab_size=100)
    return Frontend(CharTokenizer(), codec.worker_info_from_proto(hello), link, 1 << 20, GatewayMetrics())


def event(rid, ids, finish=common_pb2.FINISH_REASON_UNSPECIFIED, **kw):
    return scheduler_pb2.TokenEvent(request_id=rid, token_ids=ids, finish_reason=finish, **kw)


def test_n_choices_get_derived_seeds_and_finish_independently():
    link = FakeLink()
    front = frontend(link)
    valid = front.validate(completion_to_raw(CompletionRequest(prompt="hi", n=3, seed=2**63 - 2), 10))
    woken = []
    gen = front.start(valid, "r", woken.append, "http")
    assert [m.request_id for m in link.submitted] == ["r#0", "r#1", "r#2"]
    assert [m.sampling.seed for m in link.submitted] == [2**63 - 2, 2**63 - 1, -(2**63)]
    gen.on_event(event("r#1", [1, 2], common_pb2.FINISH_REASON_LENGTH))
    assert not gen.done
    gen.abort()
    assert gen.done and sorted(link.aborted) == ["r#0", "r#2"] and woken  # the consumer is woken
    assert gen.on_event(event("r#0", [3])) is None  # late events of an aborted choice are dropped


def test_a_duplicate_id_never_aborts_the_request_that_owns_it():
    link = FakeLink(in_flight={"r#1"})
    front = frontend(link)
    valid = front.validate(completion_to_raw(CompletionRequest(prompt="hi", n=2), 10))
    with pytest.raises(ValueError):
        front.start(valid, "r", lambda _: None, "grpc")
    assert link.aborted == ["r#0"]


def test_a_rejection_aborts_every_choice():
    link = FakeLink()
    front = frontend(link)
    gen = front.start(front.validate(completion_to_raw(CompletionRequest(prompt="hi", n=2), 10)), "r",
                      lambda _: None, "grpc")
    with pytest.raises(Rejected):
        gen.on_event(event("r#0", [], rejected=True, reject_code=scheduler_pb2.REJECT_CODE_UNAVAILABLE,
                           message="no worker"))
    assert sorted(link.aborted) == ["r#0", "r#1"] and gen.done


def test_derived_seed_keeps_none_and_wraps():
    assert derived_seed(None, 3) is None
    assert derived_seed(5, 0) == 5 and derived_seed(-1, 1) == 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": [[1]] * 257}, "prompt"),
])
def test_unsupported_or_bad_completion_fields_are_named(body, param):
    with pytest.raises(ValidationError) as info:
        request = CompletionRequest.model_validate(body)
        for prompt in completion_prompts(request):
            completion_to_raw(request, 10, prompt)
    assert info.value.field == param


def test_a_batch_of_prompts_is_one_request_per_prompt():
    request = CompletionRequest(prompt=[[1, 2], [3]], n=2)
    assert completion_prompts(request) == [[1, 2], [3]]
    assert [completion_to_raw(request, 10, p).prompt_token_ids for p in completion_prompts(request)] == [[1, 2], [3]]
    assert completion_prompts(CompletionRequest(prompt=[5, 6])) == [[5, 6]]  # token ids: one prompt
    assert completion_prompts(CompletionRequest(prompt=["a"])) == ["a"]


def test_chat_maps_max_completion_tokens_and_renders_text_parts():
    seen = []

    def render(messages, add_generation_prompt, tools, continue_final_message, template_kwargs):
        seen.append((messages, add_generation_prompt))
        assert tools is None and not continue_final_message and template_kwargs == {}
        return [1, 2, 3]

    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "add_generation_prompt": False, "stop": "x"})
    raw = chat_to_raw(body, 10)
    assert raw.max_tokens == 7 and raw.stop == ["x"]
    front = frontend(FakeLink())
    front.render_chat = render
    assert front.validate(raw).prompt_token_ids == (1, 2, 3)
    assert seen == [([{"role": "user", "content": "ab"}], False)]
    assert openai_param("sampling.max_tokens", chat=True) == "max_completion_tokens"
    assert openai_param("prompt.token_ids", chat=True) == "messages"


@pytest.mark.parametrize("fields, param, reason", [
    ({"continue_final_message": True}, "continue_final_message", "cannot be set with add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools' is set by the server"),
    ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs", "'bos_token' is set by the server"),
    ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs", "is not a template variable name"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(65)}}, "chat_template_kwargs", "at most 64 names"),
])
def test_chat_rendering_options_are_checked_before_rendering(fields, param, reason):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}], **fields})
    front = frontend(FakeLink())
    front.render_chat = lambda *a, **k: pytest.fail("rendered")
    with pytest.raises(ValidationError) as info:
        front.validate(chat_to_raw(body, 10))
    assert info.value.field == param and reason in info.value.reason
    assert openai_param(info.value.field, chat=True) == param


def test_chat_chunks_send_the_role_first_once_per_choice():
    from gateway.generation import ChoiceOutput
    from gateway.output import FinishReason, Output

    fmt = ChatFormat("id", "m", 2)
    first = fmt.chunk(ChoiceOutput(1, Output("he", (1,), num_output_tokens=1)))
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "he"}]
    last = fmt.chunk(ChoiceOutput(1, Output("y", (2,), FinishReason.STOP, "\n", 2), 4, 1))
    assert [c["choices"][0]["delta"] for c in last] == [{"content": "y"}, {}]
    assert last[-1]["choices"][0]["finish_reason"] == "stop"
    assert fmt.usage() == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                           "prompt_tokens_details": {"cached_tokens": 1}}


def test_completion_echo_is_sent_once_per_choice():
    from gateway.generation import ChoiceOutput
    from gateway.output import Output

    fmt = CompletionFormat("id", "m", 2, ["PROMPT"])
    for index in (0, 1, 0):
        fmt.accumulate(ChoiceOutput(index, Output("t", (1,), num_output_tokens=1)))
    assert [c["text"] for c in fmt.full()["choices"]] == ["PROMPTtt", "PROMPTt"]


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "presence_penalty": 2.5}, "sampling.presence_penalty"),
    ({"prompt": "x", "frequency_penalty": float("nan")}, "sampling.frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": 11.0}, "sampling.repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"100": 1.0}}, "sampling.logit_bias"),  # vocab is 100
    ({"prompt": "x", "logit_bias": {"5": 101.0}}, "sampling.logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1025)}}, "sampling.logit_bias"),
])
def test_penalty_and_bias_ranges_are_enforced(body, field):
    front = frontend(FakeLink())
    with pytest.raises(ValidationError) as info:
        front.validate(completion_to_raw(CompletionRequest.model_validate(body), 10))
    assert info.value.field == field


def test_penalties_and_bias_reach_the_sampling_params():
    front = frontend(FakeLink())
    body = {"prompt": "x", "logit_bias": {"9": -3.5, "2": 1.0}, "repetition_penalty": 1.2,
            "presence_penalty": 0.5, "frequency_penalty": -0.25}
    sampling = front.validate(completion_to_raw(CompletionRequest.model_validate(body), 10)).sampling
    assert sampling.logit_bias == ((2, 1.0), (9, -3.5))
    assert (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == (1.2, 0.5, -0.25)
    assert sampling.uses_penalties
