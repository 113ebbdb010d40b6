"""Real daemons end to end: gateway → scheduler → worker on 127.0.0.1, against HF. `serve`,
`hf` and `metrics_port` are the session's (tests/service/conftest.py)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from stepahead.v1 import common_pb2, generation_pb2
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.service.harness import Serve
from tests.service.hf_oracle import HFGreedy
from tests.model.oracle import assert_matches_hf


def greedy_request(ids, max_tokens: int, **kw) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling, **kw)


def collect(stub, request) -> tuple[list[int], str, generation_pb2.GenerateResponse]:
    tokens, text, last = [], "", None
    for msg in stub.Generate(request, timeout=120):
        tokens += msg.token_ids
        text += msg.text
        last = msg
    return tokens, text, last


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def check_against_hf(hf: HFGreedy, prompts, outputs, max_tokens) -> None:
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        want, gaps = hf.generate(prompt, max_tokens[i])
        assert len(got) == max_tokens[i]
        assert_matches_hf(got, want, gaps, f"request {i}")


def run_concurrently(stub, prompts, max_tokens) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        futs = [pool.submit(collect, stub, greedy_request(p, m)) for p, m in zip(prompts, max_tokens)]
        return [f.result()[0] for f in futs]


def test_32_concurrent_greedy_requests_match_hf(serve, hf, tiny_tokenizer):  # noqa: F811
    prompts = random_prompts(32, 1, 200, len(tiny_tokenizer), seed=1)
    max_tokens = [random.Random(i).randint(8, 32) for i in range(32)]
    outputs = run_concurrently(serve.gateway, prompts, max_tokens)
    check_against_hf(hf, prompts, outputs, max_tokens)
    stats = serve.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_tokens_identical(tiny_model_dir, hf, tiny_tokenizer, mode):  # noqa: F811
    flags = ["--num-gpu-blocks-override", "16", "--block-size", "16", "--preemption-mode", mode]
    prompts = random_prompts(8, 30, 60, len(tiny_tokenizer), seed=2)
    max_tokens = [40] * len(prompts)
    with Serve(tiny_model_dir, *flags) as s:
        outputs = run_concurrently(s.gateway, prompts, max_tokens)
        stats = s.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small to avoid preemption"
    assert stats.num_finished >= len(prompts)
    check_against_hf(hf, prompts, outputs, max_tokens)


def test_shared_prefix_hits_the_cache(serve, hf, tiny_tokenizer):  # noqa: F811
    prefix = random_prompts(1, 96, 96, len(tiny_tokenizer), seed=3)[0]
    prompts = [prefix + tail for tail in random_prompts(5, 1, 20, len(tiny_tokenizer), seed=4)]
    before = serve.stats()
    first = collect(serve.gateway, greedy_request(prompts[0], 8))[0]  # fills the cache
    rest = run_concurrently(serve.gateway, prompts[1:], [8] * 4)
    after = serve.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 4 * 96
    check_against_hf(hf, prompts, [first, *rest], [8] * 5)


def test_cancel_mid_stream_frees_every_block(serve):
    call = serve.gateway.Generate(greedy_request([5, 6, 7], 1500))
    got = [next(call) for _ in range(3)]
    assert all(m.token_ids for m in got)
    before = serve.stats()
    call.cancel()
    deadline = time.monotonic() + 1.0
    while True:
        stats = serve.stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            break
        assert time.monotonic() < deadline, f"blocks not freed within 1 s: {stats}"
    assert stats.num_aborted == before.num_aborted + 1


BAD_REQUESTS = {
    "empty prompt": generation_pb2.GenerateRequest(text=""),
    "empty token ids": generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[])),
    "prompt too long": generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5] * 2048)),
    "max_tokens 0": generation_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(max_tokens=0)),
    "max_tokens too big": generation_pb2.GenerateRequest(
        text="x", sampling=common_pb2.SamplingParams(max_tokens=5000)),
    "temperature < 0": generation_pb2.GenerateRequest(
        text="x", sampling=common_pb2.SamplingParams(temperature=-1)),
    "top_p 0": generation_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(top_p=0.0)),
    "top_p > 1": generation_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(top_p=1.5)),
    "top_k < -1": generation_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(top_k=-2)),
    "min_p > 1": generation_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(min_p=2.0)),
    "min_p < 0": generation_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(min_p=-0.5)),
    "token id outside vocab": generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 10**6])),
    "stop list too long": generation_pb2.GenerateRequest(text="x", stop=[f"s{i}" for i in range(17)]),
    "oversized message": generation_pb2.GenerateRequest(text="x" * (2 << 20)),
    "unknown model": generation_pb2.GenerateRequest(text="x", model="gpt-9"),
    "priority below range": generation_pb2.GenerateRequest(text="x", priority=-5000),
    "min_tokens > max_tokens": generation_pb2.GenerateRequest(
        text="x", sampling=common_pb2.SamplingParams(max_tokens=2, min_tokens=3)),
}


def test_bad_inputs_are_rejected_while_good_requests_finish(serve, hf, tiny_tokenizer):  # noqa: F811
    prompts = random_prompts(4, 5, 40, len(tiny_tokenizer), seed=5)
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(collect, serve.gateway, greedy_request(p, 24)) for p in prompts]
        for name, request in BAD_REQUESTS.items():
            with pytest.raises(grpc.RpcError) as info:
                list(serve.gateway.Generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert ":" in info.value.details() and len(info.value.details()) > 10, name
        outputs = [f.result()[0] for f in good]
    check_against_hf(hf, prompts, outputs, [24] * 4)
    stats = serve.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_streamed_text_is_the_decoded_output(serve, tiny_tokenizer):  # noqa: F811
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=7, max_tokens=64, ignore_eos=True)
    request = generation_pb2.GenerateRequest(text="def main(argv):\n    ", sampling=sampling)
    tokens, text, last = collect(serve.gateway, request)
    assert text == tiny_tokenizer.decode(tokens, skip_special_tokens=True)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == len(tokens) == 64
    again, _, _ = collect(serve.gateway, request)
    assert again == tokens, "the same seed must give the same tokens"


def test_stop_string_ends_the_request(serve):
    base = greedy_request([11, 12, 13, 14], 40)
    _, full_text, _ = collect(serve.gateway, base)
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    assert stop, "the unstopped output is needed as the oracle"
    request = greedy_request([11, 12, 13, 14], 40, stop=[stop])
    _, text, last = collect(serve.gateway, request)
    assert text == full_text[: full_text.index(stop)]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP and last.stop_reason == stop


def test_prometheus_metrics_follow_the_traffic(serve, metrics_port):
    import urllib.request

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                         if line and not line.startswith("#"))}

    before = scrape()
    collect(serve.gateway, greedy_request([7, 8, 9], 5))
    after = scrape()
    for key in ("stepahead:time_to_first_token_seconds_count", "stepahead:request_queue_time_seconds_count",
                'stepahead:request_finished_total{finished_reason="length"}'):
        assert after[key] == before.get(key, 0) + 1, key
    itl = "stepahead:inter_token_latency_seconds_count"
    assert after[itl] - before.get(itl, 0) >= 1
    running = [v for k, v in after.items() if k.startswith("stepahead:num_requests_running{replica=")]
    assert running == [0.0] and after["stepahead:workers_attached"] == 1, running  # one replica, by worker id
    steps = [k for k in after if k.startswith("stepahead:scheduler_steps_total{replica=")]
    assert len(steps) == 1 and after[steps[0]] > before.get(steps[0], 0), steps  # counters per replica too
    assert not [k for k in after if k.startswith("stepahead:num_requests") and k.endswith("_total")]
    assert after['stepahead:gc_pause_seconds_count{generation="2"}'] >= 1  # at least the heap freeze's


def test_a_request_finishing_on_its_first_token_records_its_queue_time(serve, metrics_port):
    import urllib.request

    def count() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                          if line.startswith("stepahead:request_queue_time_seconds_count")))

    before = count()
    collect(serve.gateway, greedy_request([7, 8, 9], 1))
    assert count() == before + 1


def test_sync_and_async_daemons_give_the_same_tokens(serve, tiny_model_dir, tiny_tokenizer):  # noqa: F811
    prompts = random_prompts(12, 1, 60, len(tiny_tokenizer), seed=9)

    def requests():
        for i, p in enumerate(prompts):
            if i % 2:
                sampling = common_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20,
                                                     ignore_eos=True)
                yield generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=p), sampling=sampling)
            else:
                yield greedy_request(p, 20)

    def run_all(stub):
        with ThreadPoolExecutor(len(prompts)) as pool:
            return [f.result()[0] for f in [pool.submit(collect, stub, r) for r in requests()]]

    async_tokens = run_all(serve.gateway)
    with Serve(tiny_model_dir, "--no-async-scheduling") as sync:
        sync_tokens = run_all(sync.gateway)
        assert sync.stats().num_steps > 0
    assert async_tokens == sync_tokens


def test_model_info_and_list_models_answer(serve, tiny_tokenizer):  # noqa: F811
    """Both unary methods (one async, one not) answer through the gateway's call guards."""
    info = serve.gateway.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert info.name == "tiny" and info.model_type == "llama" and info.vocab_size == len(tiny_tokenizer)
    listed = serve.gateway.ListModels(generation_pb2.ListModelsRequest(), timeout=10)
    assert [m.name for m in listed.models] == ["tiny"]
    with pytest.raises(grpc.RpcError) as err:
        serve.gateway.GetModelInfo(generation_pb2.GetModelInfoRequest(model="gpt-9"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
