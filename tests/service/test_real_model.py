"""The real built-in model (`smollm2-135m`) through all three daemons equals Hugging Face.

Oracle: `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`
on the converted directory; greedy `generate` with the model's own EOS. What the clients
received (every token id and the text, over gRPC and over HTTP with the `openai` client) is
compared, not what the server counted. Two systems: the default one (async scheduling,
prefix caching), and a synchronous one with a KV pool too small for its batch (preemption).
"""

from __future__ import annotations

import json
import math
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from testing.launcher import ServeProcess
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2
from tests.fixtures_models import smollm2_model_dir  # noqa: F401
from tests.model.oracle import TIE_GAP
from tests.service.test_e2e import collect

MAX_TOKENS = 24
PREEMPT_TOKENS = 40  # the preemption test's outputs: long enough to outgrow its pool
CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
COMPLETIONS = ["def fibonacci(n):", "Once upon a time, in a small village,"]
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def oracle(smollm2_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir, dtype=torch.float32).eval()
    return tokenizer, model


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


_HF_CACHE: dict[tuple, tuple[list[int], list[float]]] = {}


@torch.inference_mode()
def hf_greedy(oracle, prompt: list[int], max_new: int = MAX_TOKENS, *,
              stop_at_eos: bool = True) -> tuple[list[int], list[float]]:
    """HF's greedy tokens, stopping at the model's EOS (kept, as the server sends it) unless
    `stop_at_eos` is False (EOS is then a token like any other, as with ignore_eos), and the
    top-2 logit gap at each step (a near-tie may legitimately go either way)."""
    key = (tuple(prompt), max_new, stop_at_eos)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _hf_generate(oracle[1], prompt, max_new, stop_at_eos)
    return _HF_CACHE[key]


def _hf_generate(model, prompt: list[int], max_new: int, stop_at_eos: bool) -> tuple[list[int], list[float]]:
    eos = model.generation_config.eos_token_id
    if not stop_at_eos:
        model.generation_config.eos_token_id = None  # as the service tests' HFGreedy does
    try:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    finally:
        model.generation_config.eos_token_id = eos
    gaps = [float(g[0] - g[1]) for g in (torch.topk(step[0].float(), 2).values for step in out.logits)]
    return out.sequences[0, len(prompt):].tolist(), gaps


def assert_same_tokens(ours: list[int], want: list[int], gaps: list[float], what: str) -> None:
    for k, (a, b) in enumerate(zip(ours, want)):
        if a != b:
            assert gaps[k] < TIE_GAP, f"{what}: token {k} is {a}, HF says {b} (top-2 gap {gaps[k]:.3g})\n{ours}\n{want}"
            return
    assert len(ours) == len(want), f"{what}: {len(ours)} tokens, HF {len(want)}\n{ours}\n{want}"


def greedy_request(*, text: str | None = None, messages=None, request_id: str = "", max_tokens: int = MAX_TOKENS,
                   ignore_eos: bool = False) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if messages is not None:
        chat = generation_pb2.Chat(messages=[generation_pb2.ChatMessage(**m) for m in messages])
        return generation_pb2.GenerateRequest(request_id=request_id, chat=chat, sampling=sampling)
    return generation_pb2.GenerateRequest(request_id=request_id, text=text, sampling=sampling)


def check_stream(oracle, prompt_ids, received, what: str) -> None:
    tokenizer, _ = oracle
    ids, text, last = received
    want, gaps = hf_greedy(oracle, prompt_ids)
    assert_same_tokens(ids, want, gaps, what)
    if ids == want:
        assert text == tokenizer.decode(want, skip_special_tokens=True), what
        stopped = bool(want) and want[-1] in tokenizer.convert_tokens_to_ids(["<|im_end|>"])
        assert last.finish_reason == (common_pb2.FINISH_REASON_STOP if stopped else common_pb2.FINISH_REASON_LENGTH)
    assert last.usage.completion_tokens == len(ids), what


def _serve(model_dir, *flags):
    return ServeProcess(model_dir, "--served-model-name", NAME, *flags, capture_stderr=True)


@pytest.fixture(scope="module")
def real(smollm2_model_dir):  # noqa: F811
    with _serve(smollm2_model_dir) as s:
        yield s
        problems = s.log_problems()
        assert not problems, problems


@pytest.fixture(scope="module")
def real_sync_preempting(smollm2_model_dir):  # noqa: F811
    """Synchronous scheduling and 8 blocks of 16 tokens (see the test that uses it)."""
    metrics_port = free_port()
    with _serve(smollm2_model_dir, "--no-async-scheduling", "--num-gpu-blocks-override", "8",
                "--metrics-port", str(metrics_port)) as s:
        yield s, metrics_port
        problems = s.log_problems()
        assert not problems, problems


def test_the_first_answer_is_a_real_sentence(real, oracle):
    """What a new user sees first: the README's question, over HTTP with the openai client."""
    tokenizer, _ = oracle
    with openai.OpenAI(base_url=real.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        out = client.chat.completions.create(model=NAME, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0)
    want, _ = hf_greedy(oracle, chat_ids(tokenizer, CHATS[0]))
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    assert out.model == NAME


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_over_grpc_equals_hf(real, oracle, i):
    tokenizer, _ = oracle
    check_stream(oracle, chat_ids(tokenizer, CHATS[i]), collect(real.gateway, greedy_request(messages=CHATS[i])),
                 f"chat {i}")


@pytest.mark.parametrize("i", range(len(COMPLETIONS)))
def test_completion_over_grpc_equals_hf(real, oracle, i):
    tokenizer, _ = oracle
    prompt = tokenizer.encode(COMPLETIONS[i])
    check_stream(oracle, prompt, collect(real.gateway, greedy_request(text=COMPLETIONS[i])), f"completion {i}")


def test_a_prefix_cache_hit_gives_the_same_answer(real, oracle):
    tokenizer, _ = oracle
    messages = [{"role": "system", "content": "You answer questions about geography in one short sentence. " * 4},
                {"role": "user", "content": "What is the capital of Italy?"}]
    body = {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    first, second = (_post(real.http_url + "/v1/chat/completions", body) for _ in range(2))
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (prompt_tokens - 1) // 16 * 16  # every whole block
    want, gaps = hf_greedy(oracle, chat_ids(tokenizer, messages))
    for out in (first, second):
        assert out["choices"][0]["message"]["content"] == tokenizer.decode(want, skip_special_tokens=True)


def test_sync_scheduling_with_preemption_equals_hf(real_sync_preempting, oracle):
    """Each request needs 3 blocks to start and 6 by its end (EOS ignored): any two running
    together outgrow the 8 blocks, so someone is preempted and recomputed or swapped."""
    serve, metrics_port = real_sync_preempting
    tokenizer, _ = oracle
    prompts = [*CHATS, [{"role": "user", "content": "Tell me a fact about the number 7."}]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        received = list(pool.map(lambda m: collect(serve.gateway, greedy_request(
            messages=m, max_tokens=PREEMPT_TOKENS, ignore_eos=True)), prompts))
    for i, (messages, (ids, text, last)) in enumerate(zip(prompts, received)):
        want, gaps = hf_greedy(oracle, chat_ids(tokenizer, messages), PREEMPT_TOKENS, stop_at_eos=False)
        assert_same_tokens(ids, want, gaps, f"sync chat {i}")
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(ids) == PREEMPT_TOKENS
        if ids == want:
            assert text == tokenizer.decode(want, skip_special_tokens=True)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    preemptions = re.search(r"^stepahead:num_preemptions_total\S* (\S+)$", metrics, re.M)
    assert preemptions and float(preemptions.group(1)) > 0, "the pool was meant to be too small for the batch"


def test_logprobs_equal_hf_log_softmax(real, oracle):
    tokenizer, model = oracle
    prompt = "The quick brown fox"
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    out = _post(real.http_url + "/v1/completions", body)["choices"][0]["logprobs"]
    ids = tokenizer.encode(prompt)
    want, _ = hf_greedy(oracle, ids, 8)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + want])).logits[0].float()
    logsoftmax = torch.log_softmax(logits, dim=-1)[len(ids) - 1:-1]  # [8, vocab]: the position before each token
    assert len(out["token_logprobs"]) == len(want)
    for k, (token_id, lp) in enumerate(zip(want, out["token_logprobs"])):
        assert math.isclose(lp, float(logsoftmax[k, token_id]), abs_tol=2e-3), (k, lp)
        top = torch.topk(logsoftmax[k], 3)
        got = sorted(out["top_logprobs"][k].values(), reverse=True)
        assert all(math.isclose(a, float(b), abs_tol=2e-3) for a, b in zip(got, top.values)), (k, got)
    assert "".join(out["tokens"]) == tokenizer.decode(want, skip_special_tokens=True)


def test_chat_logprob_bytes_are_each_tokens_own_bytes(real, oracle):
    """OpenAI's chat logprobs `bytes`: each token's own bytes, also for a token that ends inside
    a character (an emoji spans several tokens here): they are HF's vocabulary bytes of the
    greedy tokens, the top-1 alternative (the token itself, at greedy) has the same, and they
    join into the content's UTF-8."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer, _ = oracle
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    messages = [{"role": "user", "content": "Write a smiley emoji"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    choice = _post(real.http_url + "/v1/chat/completions", body)["choices"][0]
    entries = choice["logprobs"]["content"]
    want, gaps = hf_greedy(oracle, chat_ids(tokenizer, messages), 12)
    same = next((k for k, gap in enumerate(gaps) if gap < TIE_GAP), len(want))
    raw = [tokenizer.convert_ids_to_tokens(t) for t in want]
    raw = [r.encode() if t in tokenizer.added_tokens_decoder else bytes(byte_of[c] for c in r) for t, r in zip(want, raw)]
    assert any(r.decode(errors="replace") != r.decode(errors="ignore") for r in raw[:same]), \
        "HF's answer was meant to split a character over tokens"
    for k, e in enumerate(entries[:same]):
        assert bytes(e["bytes"]) == raw[k] == bytes(e["top_logprobs"][0]["bytes"]), (k, e)
    text_entries = entries[:-1] if choice["finish_reason"] == "stop" else entries  # EOS: an entry, not text
    joined = b"".join(bytes(e["bytes"]) for e in text_entries)  # a cut mid-character ends the text in U+FFFD
    assert joined.decode(errors="replace") == choice["message"]["content"]


def test_json_schema_answer_is_valid_json_with_real_words(real):
    schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
              "required": ["country", "capital"], "additionalProperties": False}
    body = {"model": NAME, "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "Give the country France and its capital as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}}
    content = _post(real.http_url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    value = json.loads(content)
    assert set(value) == {"country", "capital"}
    for field in ("country", "capital"):
        assert re.fullmatch(r"[A-Za-z]{3,}( [A-Za-z]+)*", value[field]), content  # words, not noise


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())
