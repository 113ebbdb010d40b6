"""Contention mode (issue 36): `stepahead serve` of the tiny model with every core kept busy
(`contention.cpu_burners`) and randomized delays in the worker's step loop and the
scheduler engine's loop (`STEPAHEAD_TEST_JITTER_MS`, `stepahead/jitter.py`), for a few seeds.
Per seed, two systems under contention, asynchronous scheduling, one with n-gram speculation:

- greedy gRPC streams equal (ids and text) to the reference of a quiet system with the
  synchronous loop (`--no-async-scheduling`, no speculation): async exactness, and
  speculation alone;
- structured outputs (a JSON schema, through the official `openai` client): greedy ones equal
  to the reference's and valid, sampled ones (temperature 0.8, seed i) valid, with and
  without speculation;
- drain: SIGTERM mid-stream; every open stream still gets exactly the reference's ids and
  text, and `serve` exits 0;
- failover (once, seed 0): the only worker SIGKILLed while every long stream is open, each
  stream still equal to the reference;
- and no daemon logged a warning or above (`log_problems` finds nothing: a step that failed
  and was retried, a lost worker or a crashed engine fails the test even if the client saw
  nothing).

Longer: `STEPAHEAD_CONTENTION_SEEDS=10` (seeds), `STEPAHEAD_CONTENTION_JITTER_MS=5`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service import contention
from tests.service.harness import Serve
from tests.service.streams import greedy, wait_idle

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind": {"enum": ["cat", "dog", "bird"]},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["count", "kind", "tags"],
    "additionalProperties": False,
}
PROMPTS = [[5, 6, 7 + i] + [40 + i, 41] * 6 for i in range(4)]  # repeats: the n-gram proposer finds drafts
SHORT, LONG = 32, 120  # tokens of the plain streams and of the drained ones
STRUCTURED = 2  # structured requests per temperature


def _stream(stub, prompt, max_tokens: int, started: threading.Event | None = None) -> dict:
    ids, text, last = [], [], None
    try:
        for msg in stub.Generate(greedy(list(prompt), max_tokens), timeout=300):
            ids += msg.token_ids
            text.append(msg.text)
            last = msg
            if started is not None:
                started.set()
    except grpc.RpcError as exc:
        return {"error": f"{exc.code()}: {exc.details()}", "ids": ids}
    finally:
        if started is not None:
            started.set()
    return {"ids": ids, "text": "".join(text), "finish": last.finish_reason if last else None}


def _streams(stub, max_tokens: int) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _stream(stub, p, max_tokens), PROMPTS))


def _structured(client: openai.OpenAI, i: int, temperature: float):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"describe pet {i}"}], max_tokens=200, seed=i,
        temperature=temperature, response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    return r.choices[0].finish_reason, r.choices[0].message.content


def _all_structured(client: openai.OpenAI, temperature: float) -> list:
    with ThreadPoolExecutor(STRUCTURED) as pool:
        return list(pool.map(lambda i: _structured(client, i, temperature), range(STRUCTURED)))


def _client(s: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):  # noqa: F811
    """A quiet system with the synchronous loop, no speculation: what every run must equal."""
    with Serve(tiny_model_dir, "--max-num-seqs", "16", "--no-async-scheduling", capture_stderr=True) as s, \
            _client(s) as client:
        ref = {"short": _streams(s.gateway, SHORT), "long": _streams(s.gateway, LONG),
               "structured": _all_structured(client, 0.0)}
        wait_idle(s)
        assert not s.log_problems(), s.log_problems()
    for r in ref["short"] + ref["long"]:
        assert "error" not in r and len(r["ids"]) in (SHORT, LONG), r
    return ref


def _check_structured(got: list, want: list | None = None) -> None:
    import jsonschema

    for i, (finish, content) in enumerate(got):
        assert finish == "stop", (i, finish, content)
        jsonschema.validate(json.loads(content), SCHEMA)
    if want is not None:
        assert got == want


def _exercise(s: Serve, reference: dict) -> None:
    """Everything but the drain, on one system under contention."""
    with _client(s) as client:
        with ThreadPoolExecutor(3) as pool:  # streams and structured requests share the batches
            short = pool.submit(_streams, s.gateway, SHORT)
            greedy_json = pool.submit(_all_structured, client, 0.0)
            sampled_json = pool.submit(_all_structured, client, 0.8)
            for i, (got, want) in enumerate(zip(short.result(), reference["short"])):
                assert got == want, (i, got, want)
            _check_structured(greedy_json.result(), reference["structured"])
            _check_structured(sampled_json.result())


def _drain(s: Serve, reference: dict) -> None:
    """SIGTERM while every long stream is open: each one still ends whole, equal to the reference."""
    started = [threading.Event() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        runs = [pool.submit(_stream, s.gateway, p, LONG, e) for p, e in zip(PROMPTS, started)]
        for e in started:
            assert e.wait(120), "a stream never got its first message"
        s.proc.send_signal(signal.SIGTERM)
        got = [r.result(timeout=300) for r in runs]
    assert s.proc.wait(timeout=120) == 0
    for i, (g, want) in enumerate(zip(got, reference["long"])):
        assert g == want, (i, len(g.get("ids", [])), g.get("error"))


@pytest.mark.parametrize("seed", contention.seeds())
def test_outputs_equal_their_reference_under_contention(tiny_model_dir, reference, seed):  # noqa: F811
    env = contention.jitter_env(seed)
    with ThreadPoolExecutor(2) as pool:  # both systems start together (the burners start after: startup is not the test)
        starting = [pool.submit(Serve, tiny_model_dir, "--max-num-seqs", "16", *flags, env=env, capture_stderr=True)
                    for flags in ((), ("--speculative-config", SPEC))]
    failed = [f.exception() for f in starting if f.exception() is not None]
    if failed:  # the other one started: stop it too
        for f in starting:
            if f.exception() is None:
                f.result().close()
        raise failed[0]
    systems = [f.result() for f in starting]
    try:
        with contention.cpu_burners():
            for s in systems:
                _exercise(s, reference)
            assert systems[1].stats().spec_num_draft_tokens > 0, "the n-gram speculator never drafted"
            for s in systems:
                wait_idle(s, timeout_s=30)
                _drain(s, reference)
    finally:
        for s in systems:
            s.close()
    for name, s in zip(("plain", "speculative"), systems):
        problems = s.log_problems()
        assert not problems, (name, problems)


def test_failover_under_contention(tiny_model_dir, reference):  # noqa: F811
    """SIGKILL the only worker while every long stream is open, burners and jitter on: serve
    restarts it, the scheduler re-runs its requests on the new one, and every stream still
    ends whole, equal to the reference. Only the loss itself may be logged."""
    from tests.service.test_tensor_parallel import worker_pids

    with Serve(tiny_model_dir, "--max-num-seqs", "16", env=contention.jitter_env(0), capture_stderr=True) as s:
        with contention.cpu_burners():
            started = [threading.Event() for _ in PROMPTS]
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                runs = [pool.submit(_stream, s.gateway, p, LONG, e) for p, e in zip(PROMPTS, started)]
                for e in started:
                    assert e.wait(120), "a stream never got its first message"
                [worker] = worker_pids(s)
                os.kill(worker, signal.SIGKILL)
                got = [r.result(timeout=300) for r in runs]
        for i, (g, want) in enumerate(zip(got, reference["long"])):
            assert g == want, (i, len(g.get("ids", [])), g.get("error"))
        problems = s.log_problems([r'"daemon": "scheduler".*"event": "worker_(lost|detached)"'])
    assert not problems, problems
