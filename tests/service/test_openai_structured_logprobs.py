"""Structured outputs and logprobs over the gateway's HTTP API, with the official `openai`
client unchanged, against the same real daemons as `test_openai_http.py` (the session
fixtures `openai_serve` / `openai_client`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.service.hf_oracle import HFGreedy
from tests.service.openai_helpers import IGNORE_EOS, USER
from tests.service.streams import wait_idle

PET_SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 20},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["kind", "age", "tags"],
    "additionalProperties": False,
}


def test_structured_outputs_and_a_grammar_the_worker_refuses_fails_alone(openai_serve, openai_client):
    import grpc
    import jsonschema

    from stepahead.v1 import common_pb2, generation_pb2

    def pet():
        return openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=60, temperature=1.0, seed=5,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}})

    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(pet)
        # Python's re accepts a look-ahead, xgrammar does not: only the worker finds out
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                      extra_body={"structured_outputs": {"regex": "(?=a)b"}})
        assert "structured_outputs.regex: does not compile" in str(refused.value)
        sampling = common_pb2.SamplingParams(
            max_tokens=5, structured_outputs=common_pb2.StructuredOutputs(grammar="root ::= undefined_rule"))
        with pytest.raises(grpc.RpcError) as rpc:
            list(openai_serve.gateway.Generate(generation_pb2.GenerateRequest(text="x", sampling=sampling), timeout=120))
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.grammar" in rpc.value.details()
        answer = good.result()
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PET_SCHEMA)
    choice = openai_client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=10, temperature=1.0, seed=3,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    wait_idle(openai_serve)
def test_a_burst_of_constraints_the_worker_refuses_is_logged_once(openai_serve, openai_client):
    """Each is a 400 for its client. The worker, which a client can reach this way at will, logs
    them at most once per 10 s (`failed_requests` counts each); it logged a warning line each."""
    logged = len([line for line in openai_serve.stderr_lines if '"event": "request_failed"' in line])
    for i in range(6):
        with pytest.raises(openai.BadRequestError):
            openai_client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                             extra_body={"structured_outputs": {"regex": f"(?=a{i})b"}})
    lines = [line for line in openai_serve.stderr_lines if '"event": "request_failed"' in line][logged:]
    assert len(lines) <= 1, lines  # none at all when the last one logged is under 10 s old
    wait_idle(openai_serve)


# ---- logprobs -------------------------------------------------------------------------------------------


def hf_log_softmax(hf: HFGreedy, ids: list[int]):
    """[len(ids), vocab]: HF's log-softmax at every position of `ids` (row i predicts ids[i + 1])."""
    import torch

    with torch.inference_mode():
        return hf.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_completion_logprobs(lp, text: str, k: int) -> None:
    """The pieces concatenate to the text, offsets follow them, top dicts hold k (+ the token)."""
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        if value is None:
            assert top is None
            continue
        assert top[token] == value and k <= len(top) <= k + 1
        assert max(top.values()) <= 0.0


def test_completion_logprobs_with_echo_equal_hf_log_softmax(openai_client, hf, tiny_tokenizer):  # noqa: F811
    ids = tiny_tokenizer.encode("import numpy as np\nx = np.")
    kw = dict(model="tiny", prompt=ids, max_tokens=8, temperature=0, echo=True, logprobs=3, extra_body=IGNORE_EOS)
    out = openai_client.completions.create(**kw)
    choice = out.choices[0]
    lp = choice.logprobs
    assert_completion_logprobs(lp, choice.text, 3)
    assert len(lp.tokens) == len(ids) + 8 and lp.token_logprobs[0] is None
    # every position against HF's log-softmax over the same ids: the generated ids are the argmax
    generated = tiny_tokenizer.encode(choice.text[len(tiny_tokenizer.decode(ids)):], add_special_tokens=False)
    full = hf_log_softmax(hf, ids + generated)
    if len(generated) == 8:  # re-tokenizing the text can merge pieces; then only the prompt part is checked
        for i in range(1, len(ids) + 8):
            target = (ids + generated)[i]
            assert abs(lp.token_logprobs[i] - float(full[i - 1, target])) < 1e-4, i
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(full[i - 1, ids[i]])) < 1e-4, i
        top = full[i - 1].topk(3)
        assert sorted(lp.top_logprobs[i].values())[-3:] == pytest.approx(sorted(top.values.tolist()), abs=1e-4)
    streamed = list(openai_client.completions.create(stream=True, **kw))
    merged = {key: sum((getattr(c.choices[0].logprobs, key) for c in streamed if c.choices and c.choices[0].logprobs),
                       []) for key in ("tokens", "token_logprobs", "text_offset")}
    assert merged["tokens"] == lp.tokens and merged["text_offset"] == lp.text_offset
    assert merged["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_completion_logprobs_0_is_the_sampled_token_only_and_stop_strings_cut_them(openai_client):
    out = openai_client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                    logprobs=0, extra_body=IGNORE_EOS)
    lp = out.choices[0].logprobs
    assert_completion_logprobs(lp, out.choices[0].text, 0)
    assert all(len(top) == 1 for top in lp.top_logprobs) and len(lp.tokens) == 12
    stop = out.choices[0].text[5:8]  # a stop string inside the greedy text
    cut = openai_client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                    logprobs=0, stop=[stop], extra_body=IGNORE_EOS)
    text, cut_lp = cut.choices[0].text, cut.choices[0].logprobs
    assert cut.choices[0].finish_reason == "stop" and len(text) < 5 + len(stop)
    assert "".join(cut_lp.tokens).startswith(text) and cut_lp.text_offset[-1] < max(len(text), 1)
    assert cut_lp.token_logprobs == lp.token_logprobs[: len(cut_lp.tokens)]


def test_chat_logprobs_format_streamed_or_not_and_n2(openai_client, hf, tiny_tokenizer):  # noqa: F811
    messages = [{"role": "user", "content": "Sort a list."}]
    plain = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, extra_body=IGNORE_EOS)  # no top_logprobs: vLLM #4795
    content = plain.choices[0].logprobs.content
    assert len(content) == 6 and all(c.top_logprobs == [] for c in content)
    assert "".join(c.token for c in content) == plain.choices[0].message.content
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    out = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([c.logprob for c in plain.choices[0].logprobs.content],
                                                         abs=1e-4)  # another batch: float rounding differs
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy
    prompt = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    first = hf_log_softmax(hf, list(prompt))[-1]
    assert content[0].logprob == pytest.approx(float(first.max()), abs=1e-4)
    chunks = list(openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True, extra_body=IGNORE_EOS))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    two = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=3, n=2,
                                         logprobs=True, top_logprobs=1, extra_body=IGNORE_EOS)
    for choice in two.choices:
        assert "".join(c.token for c in choice.logprobs.content) == choice.message.content
    assert two.choices[0].logprobs.content != two.choices[1].logprobs.content


def test_grpc_logprobs_and_prompt_logprobs_match_http(openai_serve, openai_client, tiny_tokenizer):  # noqa: F811
    import grpc

    from stepahead.v1 import common_pb2, generation_pb2

    ids = tiny_tokenizer.encode("while True:")
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    msgs = list(openai_serve.gateway.Generate(generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling), timeout=120))
    token_ids = [t for m in msgs for t in m.token_ids]
    logprobs = [e for m in msgs for e in m.logprobs]
    prompt = [e for m in msgs for e in m.prompt_logprobs]
    assert [e.token_id for e in logprobs] == token_ids and all(len(e.top_token_ids) == 2 for e in logprobs)
    assert [e.token_id for e in prompt] == ids[1:]
    http = openai_client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, echo=True, logprobs=2,
                                     extra_body=IGNORE_EOS).choices[0].logprobs
    ours = [e.logprob for e in prompt] + [e.logprob for e in logprobs]
    assert ours == pytest.approx(http.token_logprobs[1:], abs=1e-6)
    import subprocess
    import sys

    cli = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--target", openai_serve.gateway_addr, "--temperature", "0",
         "--max-tokens", "6", "--ignore-eos", "--logprobs", "2", "while True:"], capture_output=True, text=True,
        timeout=120)
    assert cli.returncode == 0, cli.stderr
    lines = [line.split() for line in cli.stderr.splitlines() if line.startswith("output ")]
    assert [int(f[2]) for f in lines] == token_ids and all(len(f) == 6 for f in lines)
    assert [float(f[3]) for f in lines] == pytest.approx([e.logprob for e in logprobs], abs=1e-3)
    bad = common_pb2.SamplingParams(max_tokens=2, logprobs=21)
    with pytest.raises(grpc.RpcError) as info:
        list(openai_serve.gateway.Generate(generation_pb2.GenerateRequest(text="x", sampling=bad), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in info.value.details()
