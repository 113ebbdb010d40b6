"""Refusals cost less than work: a burst of oversized prompts and chats is refused, each
with 400 / INVALID_ARGUMENT naming the field, before anything is tokenized or rendered,
and the gateway's memory comes back once the burst is over. Also: every route of the
HTTP app but /health refuses a missing or wrong API key."""

from __future__ import annotations

import json
import random
import string
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx2 as httpx
import pytest
from starlette.testclient import TestClient

from gateway.http_server import OpenAIServer
from stepahead.v1 import common_pb2, generation_pb2
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve

BURST = 16
RSS_GROWTH_BOUND_MB = 120
# many tokens per character (a tokenizer's worst case): tokenizing it is what a refusal must not cost
NOISE = "".join(random.Random(0).choice(string.ascii_letters + string.digits + " .,;") for _ in range(900_000))


@pytest.fixture(scope="module")
def daemons(tiny_model_dir):  # noqa: F811
    with Serve(tiny_model_dir, capture_stderr=True) as s:
        yield s
        problems = s.log_problems()  # refusals are answers, not failures: nothing at warning or above
        assert not problems, problems


def _gateway_rss_mb(serve) -> float:
    for pid in serve.child_pids():
        if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3:4] == [b"gateway"]:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    raise AssertionError("no gateway process")


def _post(serve, path: str, content: bytes) -> httpx.Response:
    return httpx.post(serve.http_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=120)


BODIES = {
    "prompt": ("/v1/completions", lambda: json.dumps({"prompt": NOISE, "max_tokens": 1}).encode()),
    "messages": ("/v1/chat/completions", lambda: json.dumps(
        {"messages": [{"role": "user", "content": "hi there"}] * 10_000, "max_tokens": 1}).encode()),
    "escaped": ("/v1/completions", lambda: b'{"max_tokens": 1, "prompt": "' + b"\\u00e9" * 170_000 + b'"}'),
}


def test_rejected_burst_returns_its_memory(daemons) -> None:
    _post(daemons, "/v1/completions", json.dumps({"prompt": "warm up", "max_tokens": 1}).encode())
    before = _gateway_rss_mb(daemons)
    with ThreadPoolExecutor(BURST) as pool:
        for kind, (path, make) in BODIES.items():
            body = make()
            assert len(body) < 1 << 20
            replies = list(pool.map(lambda _: _post(daemons, path, body), range(BURST)))
            for reply in replies:
                assert reply.status_code == 400, reply.text
                assert reply.json()["error"]["param"] == ("messages" if kind == "messages" else "prompt")
    time.sleep(3)  # the burst settles
    after = _gateway_rss_mb(daemons)
    print(f"gateway RSS {before:.0f} MB before the burst, {after:.0f} MB after it settled")
    assert after - before < RSS_GROWTH_BOUND_MB, (before, after)


def test_oversized_body_is_refused_before_parsing(daemons) -> None:
    reply = _post(daemons, "/v1/completions", b'{"prompt": "' + b"x" * (1 << 20) + b'"}')
    assert reply.status_code == 413


def test_grpc_refusal_names_the_field(daemons) -> None:
    request = generation_pb2.GenerateRequest(text="hello " * 150_000, sampling=common_pb2.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as info:
        list(daemons.gateway.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("prompt.text:")
    nul = generation_pb2.GenerateRequest(text="a\0b", sampling=common_pb2.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as info:
        list(daemons.gateway.Generate(nul, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NUL" in info.value.details()


KEY = "the-right-key"
WRONG = {
    "no header": {},
    "no token": {"authorization": "Bearer "},
    "wrong key": {"authorization": "Bearer another-key"},
    "prefix": {"authorization": "Bearer " + KEY[:-1]},
    "extension": {"authorization": "Bearer " + KEY + "x"},
    "not bearer": {"authorization": KEY},
    "basic": {"authorization": "Basic " + KEY},
    "another scheme of Bearer's length": {"authorization": "Token: " + KEY},
}
OPEN_ROUTES = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect"}  # health and the API documentation


def test_every_route_refuses_a_wrong_key() -> None:
    """Walks the app's own route table, so a route added later is covered too."""
    rejected = []
    frontend = SimpleNamespace(metrics=SimpleNamespace(observe_rejected=lambda *_: rejected.append(1)),
                               model=SimpleNamespace(model_name="m", max_model_len=8))
    app = OpenAIServer(frontend, lambda: True, None, (KEY,)).app
    routes = [(m, r.path) for r in app.routes if getattr(r, "methods", None) for m in sorted(r.methods)]
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics", "/version"} <= {p for _, p in routes}
    with TestClient(app) as client:
        for method, path in routes + [("GET", "/no/such/route"), ("POST", "/v1/models/")]:
            for case, headers in WRONG.items():
                status = client.request(method, path, headers=headers).status_code
                if path in OPEN_ROUTES:
                    assert status != 401, (method, path, case)
                else:
                    assert status == 401, (method, path, case)
        assert client.get("/version", headers={"authorization": "Bearer " + KEY}).status_code == 200
    assert rejected
