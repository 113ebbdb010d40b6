"""The official `openai` client, unchanged, against real daemons over the gateway's HTTP port."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.model.oracle import TIE_GAP
from tests.service.openai_helpers import IGNORE_EOS, USER, assert_hf_text, hf_text
from tests.service.streams import wait_idle

def test_models_health_version_metrics(openai_serve, openai_client):
    models = openai_client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert openai_client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-9")
    assert httpx.get(openai_serve.http_url + "/health").status_code == 200
    assert httpx.get(openai_serve.http_url + "/version").json()["version"]
    openai_client.completions.create(model="tiny", prompt="x", max_tokens=2)
    metrics = httpx.get(openai_serve.http_url + "/metrics").text
    assert 'stepahead:gateway_requests_started_total{transport="http"}' in metrics
    assert 'stepahead:gateway_sequences_finished_total{reason="length",transport="http"}' in metrics


def test_completion_greedy_equals_hf_streaming_or_not(openai_client, hf, tiny_tokenizer):  # noqa: F811
    prompt = "def fibonacci(n):\n"
    full = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body=IGNORE_EOS)
    expected = hf_text(hf, tiny_tokenizer, tiny_tokenizer.encode(prompt), 24)
    assert_hf_text(full.choices[0].text, expected)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt))

    chunks = list(openai_client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completion_token_prompt_and_echo(openai_client, hf, tiny_tokenizer):  # noqa: F811
    ids = tiny_tokenizer.encode("import numpy as np\n")
    out = openai_client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, echo=True,
                                    extra_body=IGNORE_EOS)
    echoed = tiny_tokenizer.decode(ids)
    assert out.choices[0].text.startswith(echoed)
    assert_hf_text(out.choices[0].text[len(echoed):], hf_text(hf, tiny_tokenizer, ids, 10))


def test_chat_prompt_is_the_chat_template_and_greedy_equals_hf(openai_client, hf, tiny_tokenizer):  # noqa: F811
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = openai_client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                         temperature=0, extra_body=IGNORE_EOS)
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.role == "assistant"
    assert_hf_text(out.choices[0].message.content, hf_text(hf, tiny_tokenizer, list(ids), 16))

    chunks = list(openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=IGNORE_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 16


def test_n_choices_are_distinct_and_reproducible_with_a_seed(openai_client):
    def run(stream: bool) -> list[str]:
        kw = dict(model="tiny", prompt="class Stack:", max_tokens=12, temperature=1.0, seed=1234, n=4,
                  extra_body=IGNORE_EOS)
        if not stream:
            out = openai_client.completions.create(**kw)
            assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
            assert out.usage.completion_tokens == 48
            return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
        texts = [""] * 4
        finished = set()
        for chunk in openai_client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason:
                    finished.add(c.index)
        assert finished == {0, 1, 2, 3}
        return texts

    first = run(stream=False)
    assert len(set(first)) == 4  # distinct seeds: distinct samples
    assert run(stream=False) == first
    assert run(stream=True) == first
    one = openai_client.completions.create(model="tiny", prompt="class Stack:", max_tokens=12, temperature=1.0,
                                    seed=1234, extra_body=IGNORE_EOS)
    assert one.choices[0].text == first[0]  # choice 0 samples with the request's own seed


def test_a_batch_of_prompts_answers_each_as_its_own_request_would(openai_client, hf, tiny_tokenizer):  # noqa: F811
    """A list of prompts (OpenAI's and vLLM's batch): prompt i's choice j is choice i * n + j,
    each greedy text is HF's for its own prompt, usage counts every prompt once."""
    prompts = ["def fibonacci(n):\n", "import numpy as np\n", "class Stack:"]
    ids = [tiny_tokenizer.encode(p) for p in prompts]
    expected = [hf_text(hf, tiny_tokenizer, i, 12) for i in ids]
    kw = dict(model="tiny", max_tokens=12, temperature=0, n=2, extra_body=IGNORE_EOS)
    for prompt in (prompts, ids):
        out = openai_client.completions.create(prompt=prompt, echo=True, **kw)
        assert [c.index for c in out.choices] == list(range(6))
        for c in out.choices:
            echoed = prompts[c.index // 2] if prompt is prompts else tiny_tokenizer.decode(ids[c.index // 2])
            assert c.text.startswith(echoed) and c.finish_reason == "length"
            assert_hf_text(c.text[len(echoed):], expected[c.index // 2])
        assert out.usage.prompt_tokens == sum(map(len, ids))
        assert out.usage.completion_tokens == 6 * 12

        texts, finished = [""] * 6, []
        chunks = list(openai_client.completions.create(prompt=prompt, stream=True,
                                                       stream_options={"include_usage": True}, **kw))
        for chunk in chunks[:-1]:
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason:
                    finished.append(c.index)
        assert sorted(finished) == list(range(6))
        for i, text in enumerate(texts):
            assert_hf_text(text, expected[i // 2])
        assert chunks[-1].usage.prompt_tokens == sum(map(len, ids))
        assert chunks[-1].usage.completion_tokens == 6 * 12


def test_continuous_usage_stats_count_what_each_chunk_delivered(openai_client, tiny_tokenizer):  # noqa: F811
    """vLLM's `stream_options.continuous_usage_stats`: every chunk's usage is the tokens
    streamed so far (counted here from the chunks' own logprobs tokens); and vLLM's fields
    sent with the values that ask for nothing (a client that sends every field) are served."""
    prompt = "def fibonacci(n):\n"
    chunks = list(openai_client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={**IGNORE_EOS, "use_beam_search": False, "length_penalty": 1.0, "guided_json": None,
                    "modalities": ["text"]}))
    seen = 0
    for chunk in chunks[:-1]:
        seen += len(chunk.choices[0].logprobs.tokens)
        assert chunk.usage.completion_tokens == seen
        assert chunk.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt))
    assert seen == 12 and chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    plain = list(openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    assert all(c.usage is None for c in plain[:-1])  # only with continuous_usage_stats


def test_closing_a_batched_stream_aborts_every_prompt_and_frees_every_block(openai_serve):
    before = openai_serve.stats()
    body = {"model": "tiny", "prompt": ["x = [", "y = {", "z = ("], "max_tokens": 1500, "n": 2, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", openai_serve.http_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    stats = wait_idle(openai_serve)
    assert stats.num_aborted == before.num_aborted + 6


def test_closing_an_n4_stream_aborts_all_and_frees_every_block(openai_serve):
    before = openai_serve.stats()
    body = {"model": "tiny", "prompt": "x = [", "max_tokens": 1500, "n": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", openai_serve.http_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    stats = wait_idle(openai_serve)
    assert stats.num_aborted == before.num_aborted + 4


def test_disconnect_before_a_non_streaming_answer_aborts_upstream(openai_serve):
    before = openai_serve.stats()
    body = {"model": "tiny", "prompt": "y = (", "max_tokens": 1500, "n": 2, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(openai_serve.http_url + "/v1/completions", json=body, timeout=1.0)
    stats = wait_idle(openai_serve, timeout_s=10)
    assert stats.num_aborted == before.num_aborted + 2


C, CH = "/v1/completions", "/v1/chat/completions"
BAD_HTTP = {  # name -> (path, body (dict, or raw bytes), status, param)
    "invalid json": (C, b"{not json", 400, None),
    "prompt missing": (C, {"max_tokens": 3}, 400, "prompt"),
    "max_tokens as string": (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    "max_tokens 0": (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens past the context": (C, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    "empty prompt": (C, {"prompt": ""}, 400, "prompt"),
    "token id outside vocab": (C, {"prompt": [1, 10**6]}, 400, "prompt"),
    "negative token id": (C, {"prompt": [1, -3]}, 400, "prompt"),
    "vLLM's old guided_json": (CH, {"messages": [{"role": "user", "content": "x"}], "guided_json": {}}, 400,
                               "guided_json"),
    "beam search": (C, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    "prompt truncation": (C, {"prompt": "x", "truncate_prompt_tokens": 4}, 400, "truncate_prompt_tokens"),
    "prompt_logprobs": (C, {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    "echo in chat": (CH, {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    "audio output": (CH, {"messages": USER, "modalities": ["text", "audio"], "audio": {"voice": "alloy"}}, 400,
                     "modalities"),
    "audio parameters": (CH, {"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    "web search": (CH, {"messages": USER, "web_search_options": {}}, 400, "web_search_options"),
    "a batch past the prompt limit": (C, {"prompt": ["a"] * 257}, 400, "prompt"),
    "an empty prompt in a batch": (C, {"prompt": ["a", ""]}, 400, "prompt"),
    "a token id outside vocab in a batch": (C, {"prompt": [[1, 2], [1, 10**6]]}, 400, "prompt"),
    "a batch mixing texts and token ids": (C, {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    "temperature < 0": (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    "temperature NaN": (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    "top_p > 1": (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    "top_k < -1": (C, {"prompt": "x", "top_k": -7}, 400, "top_k"),
    "n = 0": (C, {"prompt": "x", "n": 0}, 400, "n"),
    "n too large": (C, {"prompt": "x", "n": 1000}, 400, "n"),
    "seed beyond int64": (C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    "too many stop strings": (C, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    "empty stop string": (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    "min_tokens > max_tokens": (C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    "priority out of range": (C, {"prompt": "x", "priority": 10**6}, 400, "priority"),
    "presence_penalty out of range": (C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    "repetition_penalty 0": (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    "logit_bias id outside vocab": (C, {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    "logit_bias key not an id": (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    "logit_bias value out of range": (C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    "unknown model": (C, {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    "chat without messages": (CH, {"messages": []}, 400, "messages"),
    "chat message without role": (CH, {"messages": [{"content": "x"}]}, 400, "messages.0.role"),
    "chat non-text content part": (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                   400, None),
    "chat top_logprobs without logprobs": (CH, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    "chat top_logprobs 21": (CH, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "chat top_logprobs -1": (CH, {"messages": USER, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    "logprobs 21": (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    "logprobs -1": (C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    "logprobs huge": (C, {"prompt": "x", "logprobs": 10**30}, 400, "logprobs"),
    "echo logprobs 21": (C, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
    "chat both max token fields": (CH, {"messages": USER, "max_tokens": 2, "max_completion_tokens": 2}, 400,
                                   "max_completion_tokens"),
    "oversized body": (C, {"prompt": "x" * (2 << 20)}, 413, None),
    "schema not a schema": (C, {"prompt": "x", "structured_outputs": {"json": {"type": 5}}}, 400,
                            "structured_outputs.json"),
    "regex does not compile": (C, {"prompt": "x", "structured_outputs": {"regex": "(a"}}, 400,
                               "structured_outputs.regex"),
    "two constraints": (C, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
                        "structured_outputs"),
    "json_schema without schema": (CH, {"messages": USER, "response_format": {"type": "json_schema"}}, 400,
                                   "response_format.json_schema.schema"),
}


def post(openai_serve, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(openai_serve.http_url + path, content=body, headers={"content-type": "application/json"},
                          timeout=30)
    return httpx.post(openai_serve.http_url + path, json=body, timeout=30)


def test_bad_http_inputs_get_openai_errors_while_good_requests_finish(openai_serve, openai_client, hf, tiny_tokenizer):  # noqa: F811
    prompts = ["def add(a, b):", "for i in range(10):", "while x:", "import os\n"]

    def good(prompt: str) -> str:
        return openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                         extra_body=IGNORE_EOS).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(good, p) for p in prompts]
        for name, (path, body, status, param) in BAD_HTTP.items():
            response = post(openai_serve, path, body)
            assert response.status_code == status, (name, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert len(error["message"]) > 10, name
            if param is not None:
                assert error["param"] == param, (name, error)
        outputs = [f.result() for f in futures]
    for prompt, text in zip(prompts, outputs):
        assert_hf_text(text, hf_text(hf, tiny_tokenizer, tiny_tokenizer.encode(prompt), 20))
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="gpt-9", prompt="x")
    wait_idle(openai_serve)


def test_sse_frames_are_json_and_end_with_done(openai_serve):
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", openai_serve.http_url + CH, json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data:"):].strip() for line in response.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_grpc_and_http_share_one_path_n_choices_and_seeds(openai_serve, openai_client):
    from stepahead.v1 import common_pb2, generation_pb2

    sampling = common_pb2.SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    texts = ["", "", ""]
    finals = []
    for msg in openai_serve.gateway.Generate(generation_pb2.GenerateRequest(text="if x:", sampling=sampling, n=3),
                                      timeout=120):
        texts[msg.index] += msg.text
        if msg.finish_reason:
            finals.append(msg.index)
    assert sorted(finals) == [0, 1, 2]
    http = openai_client.completions.create(model="tiny", prompt="if x:", max_tokens=10, temperature=1.0, seed=99, n=3,
                                     extra_body=IGNORE_EOS)
    assert texts == [c.text for c in sorted(http.choices, key=lambda c: c.index)]


def test_penalties_and_logit_bias_over_http_equal_hf_processors(openai_client, hf, tiny_tokenizer):  # noqa: F811
    prompt = "def parse(line):\n"
    ids = tiny_tokenizer.encode(prompt)
    plain_tokens, _ = hf.generate(ids, 16)
    bias = {plain_tokens[0]: -100.0, ids[-1]: 2.5}  # the plain first token is ruled out
    out = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                    logit_bias={str(k): v for k, v in bias.items()},
                                    extra_body={"repetition_penalty": 1.8, **IGNORE_EOS})
    tokens, gaps = hf.generate(ids, 16, repetition_penalty=1.8, sequence_bias={(k,): v for k, v in bias.items()})
    tie = next((i for i, gap in enumerate(gaps) if gap < TIE_GAP), len(tokens))
    expected = (tiny_tokenizer.decode(tokens, skip_special_tokens=True),
                tiny_tokenizer.decode(tokens[:tie], skip_special_tokens=True))
    assert_hf_text(out.choices[0].text, expected)
    plain = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body=IGNORE_EOS)
    assert plain.choices[0].text != out.choices[0].text


def test_a_stop_token_ends_the_ids_but_not_the_text_unless_asked(openai_client, hf, tiny_tokenizer):  # noqa: F811
    """`stop_token_ids` (vLLM's rule): the token is counted and named in stop_reason, and the text
    is HF's decode of the tokens before it, streamed or not; with include_stop_str_in_output the
    text has it too."""
    prompt = "def fibonacci(n):\n"
    tokens, gaps = hf.generate(tiny_tokenizer.encode(prompt), 8)
    tie = next((i for i, gap in enumerate(gaps) if gap < TIE_GAP), len(tokens))
    k = next(i for i in range(2, tie) if tokens[i] not in tokens[:i])  # the stop token's first appearance
    for include in (False, True):
        for stream in (False, True):
            body = {"stop_token_ids": [tokens[k]], "include_stop_str_in_output": include, **IGNORE_EOS}
            got = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                   stream=stream, extra_body=body,
                                                   **({"stream_options": {"include_usage": True}} if stream else {}))
            chunks = list(got) if stream else [got]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            last = [c for c in chunks if c.choices][-1].choices[0]
            assert text == tiny_tokenizer.decode(tokens[:k + int(include)], skip_special_tokens=True), (include, stream)
            assert (last.finish_reason, last.stop_reason, chunks[-1].usage.completion_tokens) == ("stop", tokens[k], k + 1)


def test_grpc_chat_and_generate_cli_render_the_same_prompt_as_http(openai_serve, openai_client, tiny_tokenizer):  # noqa: F811
    import subprocess
    import sys

    from stepahead.v1 import common_pb2, generation_pb2

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a sort."}]
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    http = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          extra_body=IGNORE_EOS)
    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(**m) for m in messages])
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    msgs = list(openai_serve.gateway.Generate(generation_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=120))
    assert msgs[-1].usage.prompt_tokens == len(ids) == http.usage.prompt_tokens
    assert "".join(m.text for m in msgs) == http.choices[0].message.content
    cli = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--target", openai_serve.gateway_addr, "--chat",
         "--system", "Be brief.", "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "Write a sort."],
        capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == http.choices[0].message.content + "\n"


def test_continuing_the_final_message_over_http_and_grpc_equals_hf(openai_serve, openai_client, hf,
                                                                   tiny_tokenizer):  # noqa: F811
    """vLLM's `continue_final_message`: the prompt is the template's up to the end of the last
    message's content (transformers' rendering), and the model continues it."""
    from stepahead.v1 import common_pb2, generation_pb2

    messages = [{"role": "user", "content": "Write a sort."}, {"role": "assistant", "content": "def sort(xs):"}]
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                             tokenize=True, return_dict=False)
    extra = {"continue_final_message": True, "add_generation_prompt": False, "chat_template_kwargs": {"unused": 1}}
    out = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                extra_body={**IGNORE_EOS, **extra})
    assert out.usage.prompt_tokens == len(ids)
    assert_hf_text(out.choices[0].message.content, hf_text(hf, tiny_tokenizer, ids, 12))
    tokenized = httpx.post(openai_serve.http_url + "/tokenize", json={"messages": messages, **extra}).json()
    assert tokenized["tokens"] == ids

    chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(**m) for m in messages], add_generation_prompt=False,
                               continue_final_message=True, chat_template_kwargs_json='{"unused": 1}')
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    msgs = list(openai_serve.gateway.Generate(generation_pb2.GenerateRequest(chat=chat, sampling=sampling), timeout=120))
    assert msgs[-1].usage.prompt_tokens == len(ids)
    assert "".join(m.text for m in msgs) == out.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:  # vLLM's rule: not both endings
        openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                              extra_body={"continue_final_message": True})
    assert refused.value.param == "continue_final_message"


# ---- first contact: schema errors, the API's own documentation, echo offsets, tokenize -------------------


def test_a_body_off_the_schema_is_a_400_the_openai_client_raises_as_bad_request(openai_client):
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model="tiny", prompt="x", max_tokens="5")
    assert bad.value.status_code == 400 and bad.value.param == "max_tokens"
    assert "max_tokens" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model="tiny", messages=[{"content": "x"}])
    assert bad.value.param == "messages.0.role"


def test_openapi_schema_and_docs_are_served_with_every_request_body(openai_serve):
    schema = httpx.get(openai_serve.http_url + "/openapi.json", timeout=30)
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(paths)
    components = schema.json()["components"]["schemas"]
    body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert {"prompt", "max_tokens", "echo", "logprobs"} <= set(components["CompletionRequest"]["properties"])
    assert "messages" in components["ChatCompletionRequest"]["properties"]
    docs = httpx.get(openai_serve.http_url + "/docs", timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower() and "/openapi.json" in docs.text


def test_echo_logprobs_of_a_string_prompt_index_the_returned_text(openai_client, tiny_tokenizer):  # noqa: F811
    prompt = "import numpy as np\nx ="
    ids = tiny_tokenizer.encode(prompt)
    assert ids[0] in tiny_tokenizer.all_special_ids  # the tokenizer adds BOS, which the text does not contain
    out = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                           logprobs=1, extra_body=IGNORE_EOS)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    assert lp.tokens[0] == ""  # BOS's share of the text
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(choice.text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))


def test_lm_eval_loglikelihood_request_echo_logprobs_of_token_ids(openai_serve, tiny_tokenizer):  # noqa: F811
    """lm-eval's `local-completions` loglikelihood: token ids of context + continuation, echo,
    logprobs 1, max_tokens 1; it sums token_logprobs[ctxlen:-1]."""
    ctx, cont = tiny_tokenizer.encode("def add(a, b):"), tiny_tokenizer.encode(" return", add_special_tokens=False)
    body = {"model": "tiny", "prompt": [ctx + cont], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True,
            "seed": 1234}
    response = httpx.post(openai_serve.http_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    lp = response.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1
    assert lp["token_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][len(ctx):-1])

    # lm-eval with batch_size > 1 sends several such prompts in one request: each choice is
    # what its prompt alone gets (its own echo, logprobs and offsets)
    others = [tiny_tokenizer.encode(t) for t in ("import os\n", "x = [1, 2")]
    body["prompt"] = [ctx + cont, *others]
    batch = httpx.post(openai_serve.http_url + "/v1/completions", json=body, timeout=60)
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for prompt, choice in zip(body["prompt"], choices):
        alone = httpx.post(openai_serve.http_url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        expected = alone.json()["choices"][0]
        # the prompt's part (the one generated token may differ on a near-tie in another batch)
        assert choice["text"].startswith(tiny_tokenizer.decode(prompt))
        assert choice["logprobs"]["tokens"][:-1] == expected["logprobs"]["tokens"][:-1]
        assert choice["logprobs"]["text_offset"] == expected["logprobs"]["text_offset"]
        assert choice["logprobs"]["token_logprobs"][:-1] == pytest.approx(expected["logprobs"]["token_logprobs"][:-1],
                                                                          abs=1e-4)  # another batch: float rounding


def test_tokenize_detokenize_and_the_models_root_follow_vllm(openai_serve, openai_client, tiny_tokenizer):  # noqa: F811
    from transformers import AutoTokenizer

    url = openai_serve.http_url
    prompt = "héllo wörld\n\tdef f(x): return x"
    card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    got = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30)
    assert got.status_code == 200, got.text
    assert got.json() == {"count": len(tiny_tokenizer.encode(prompt)), "max_model_len": card["max_model_len"],
                          "tokens": tiny_tokenizer.encode(prompt)}
    bare = httpx.post(url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False}, timeout=30).json()
    assert bare["tokens"] == tiny_tokenizer.encode(prompt, add_special_tokens=False)
    messages = [{"role": "user", "content": "Sort a list."}]
    chat = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=30).json()
    assert chat["tokens"] == tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)
    back = httpx.post(url + "/detokenize", json={"model": "tiny", "tokens": got.json()["tokens"]}, timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": tiny_tokenizer.decode(got.json()["tokens"])}

    # the model's root is a directory a client loads the same tokenizer from (lm-eval does)
    assert AutoTokenizer.from_pretrained(card["root"]).encode(prompt) == got.json()["tokens"]

    for path, body, status, param in (
            ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
            ("/tokenize", {"prompt": 5}, 400, "prompt"),
            ("/detokenize", {"tokens": [1, 10**7]}, 400, "tokens"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens")):
        response = httpx.post(url + path, json=body, timeout=30)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (path, body, response.json())


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only(openai_client, tiny_tokenizer):  # noqa: F811
    prompt = "def add(a, b):\n    return a + b"
    ids = tiny_tokenizer.encode(prompt)
    out = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                           temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert "".join(choice.logprobs.tokens) == prompt
    streamed = list(openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                                     temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == prompt
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == choice.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as bad:  # without echo there is nothing to return
        openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert bad.value.param == "max_tokens"
