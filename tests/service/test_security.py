"""The closed internal plane and the public API's credentials, against real daemons.

Findings covered: anyone who reached the scheduler could attach a worker with a copied
hello (reading every prompt, writing every output) and abort other gateways' requests by
id; no TLS or API keys anywhere; reflection exposed the internal proto; the HTTP API's keys
were checked in-process only (they went through Starlette's `BaseHTTPMiddleware`, a task hop
per streamed message), and the TLS test never spoke HTTPS.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys

import grpc
import httpx2 as httpx
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stepahead import security
from stepahead.ports import free_port
from stepahead.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from testing.certs import make_certs
from tests.service.harness import Serve
from tests.service.streams import ConnectSession, greedy, wait_health, wait_idle

HELLO = scheduler_pb2.WorkerHello(worker_id="rogue", model_name="tiny", model_type="llama", dtype="float32",
                                  device="cpu", block_size=16, num_device_blocks=64, max_model_len=2048,
                                  vocab_size=4096)


@pytest.fixture(scope="module")
def serve(tiny_model_dir):  # noqa: F811
    with Serve(tiny_model_dir, "--api-key", "key-one,key-two") as s:
        yield s


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    return info.value.code()


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_internal_calls_need_the_cluster_token(serve, token):
    with security.channel(serve.scheduler_addr, cluster_token=token) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        rogue = stub.AttachWorker(iter([scheduler_pb2.WorkerMessage(hello=HELLO)]))
        assert _code(lambda: next(rogue)) == grpc.StatusCode.UNAUTHENTICATED  # no plan ever reached it
        connect = stub.Connect(iter([scheduler_pb2.GatewayMessage(abort=scheduler_pb2.AbortRequest(request_id="x"))]))
        assert _code(lambda: next(connect)) == grpc.StatusCode.UNAUTHENTICATED
        for rpc, msg in ((stub.GetStats, scheduler_pb2.GetStatsRequest()), (stub.GetModel, scheduler_pb2.GetModelRequest()),
                         (stub.GetFlightRecord, scheduler_pb2.GetFlightRecordRequest())):
            assert _code(lambda: rpc(msg, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    wait_health(serve.scheduler_addr, serving=True)  # probes need no credential; the real worker is still there
    assert serve.stats().num_total_blocks > 0


def test_internal_reflection_is_off(serve):
    with serve.scheduler_channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        assert _code(lambda: next(call)) == grpc.StatusCode.UNIMPLEMENTED


def test_public_calls_need_an_api_key(serve):
    request = generation_pb2.GenerateRequest(text="x", sampling=common_pb2.SamplingParams(max_tokens=2))
    for key in (None, "nope"):
        with security.channel(serve.gateway_addr, api_key=key) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            assert _code(lambda: stub.Generate(request, timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: stub.ListModels(generation_pb2.ListModelsRequest(), timeout=30)) \
                == grpc.StatusCode.UNAUTHENTICATED
    with security.channel(serve.gateway_addr, api_key="key-two") as channel:
        messages = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    assert messages[-1].finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    wait_health(serve.gateway_addr, serving=True)  # health stays open for probes


def test_http_calls_need_an_api_key_and_a_keyed_stream_behaves_as_any(serve):
    url = serve.http_url
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    # which keys and routes: test_rejected_burst.py walks the app's route table; here the real server
    refused = httpx.post(url + "/v1/completions", json=body, headers={"authorization": "Bearer nope"}, timeout=30)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["type"] == "authentication_error"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # probes stay open

    with openai.OpenAI(base_url=url + "/v1", api_key="key-two", max_retries=0, timeout=120) as client:
        options = dict(model="tiny", prompt=body["prompt"], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**options)
        chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    assert whole.usage.completion_tokens == 12
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text  # the same greedy text
    assert chunks[-1].usage.completion_tokens == 12

    before = serve.stats()  # a keyed stream the client leaves is aborted upstream (disconnects pass the check)
    long = dict(body, max_tokens=1500, n=2, stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=long, headers={"authorization": "Bearer key-one"},
                      timeout=60) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data:"))
    assert wait_idle(serve, timeout_s=30).num_aborted == before.num_aborted + 2


def test_a_gateway_can_abort_only_its_own_requests(serve):
    """Two Connect streams use the same request id: no collision, no probing, and an abort
    on one stream never touches the other's request."""
    first, second = ConnectSession(serve.scheduler_channel()), ConnectSession(serve.scheduler_channel())
    try:
        long = scheduler_pb2.SubmitRequest(request_id="same-id", prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=300, ignore_eos=True))
        first.submit(long)
        first.first_event("same-id")
        second.submit(long)
        second.first_event("same-id")
        second._outbox.put(scheduler_pb2.GatewayMessage(abort=scheduler_pb2.AbortRequest(request_id="same-id")))
        assert second.last_event("same-id").finish_reason == common_pb2.FINISH_REASON_ABORT
        final = first.last_event("same-id")
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and not final.rejected
    finally:
        first.close()
        second.close()


def _spawn(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli", *args],
                            env=dict(os.environ, STEPAHEAD_LOG_LEVEL="warning", **env))


def test_tls_and_mtls_on_both_planes(tmp_path, tiny_model_dir):  # noqa: F811
    certs = make_certs(tmp_path)
    sched_port, gw_port, http_port = free_port(), free_port(), free_port()
    token = {"STEPAHEAD_CLUSTER_TOKEN": "t0k3n"}
    client_tls = ["--scheduler-ssl-ca-certs", str(certs.ca), "--scheduler-ssl-certfile", str(certs.client_cert),
                  "--scheduler-ssl-keyfile", str(certs.client_key)]
    procs = [
        _spawn("scheduler", "--port", str(sched_port), "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile",
               str(certs.server_key), "--ssl-ca-certs", str(certs.ca), env=token),
        _spawn("worker", "--scheduler", f"localhost:{sched_port}", "--model", str(tiny_model_dir), *client_tls,
               env=token),
        _spawn("gateway", "--scheduler", f"localhost:{sched_port}", "--port", str(gw_port), "--http-port",
               str(http_port), "--model",
               str(tiny_model_dir), "--ssl-certfile", str(certs.server_cert), "--ssl-keyfile", str(certs.server_key),
               *client_tls, env=dict(token, STEPAHEAD_API_KEY="k")),
    ]
    try:
        server_only = security.TLSFiles(ca_certs=str(certs.ca))
        with security.channel(f"localhost:{gw_port}", api_key="k", tls=server_only) as channel:
            grpc.channel_ready_future(channel).result(timeout=120)
            stub = generation_pb2_grpc.GenerationStub(channel)
            messages = list(stub.Generate(greedy([5, 6, 7], 4), timeout=120, wait_for_ready=True))
            assert sum(len(m.token_ids) for m in messages) == 4
            wait_health(f"localhost:{gw_port}", serving=True, channel=channel)  # ready: HTTP listens too
        https = ssl.create_default_context(cafile=str(certs.ca))  # the HTTP API on the same certificate
        with openai.OpenAI(base_url=f"https://localhost:{http_port}/v1", api_key="k", max_retries=0, timeout=120,
                           http_client=openai.DefaultHttpxClient(verify=https)) as client:
            out = client.completions.create(model=str(tiny_model_dir), prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
            httpx.get(f"http://localhost:{http_port}/health", timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{gw_port}") as plain:  # plaintext to a TLS port
            stub = generation_pb2_grpc.GenerationStub(plain)
            assert _code(lambda: stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10)) \
                == grpc.StatusCode.UNAVAILABLE
        no_client_cert = security.TLSFiles(ca_certs=str(certs.ca))  # mTLS: the scheduler wants a certificate
        with security.channel(f"localhost:{sched_port}", cluster_token="t0k3n", tls=no_client_cert) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            assert _code(lambda: stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)) \
                == grpc.StatusCode.UNAVAILABLE
        mtls = security.TLSFiles(str(certs.client_cert), str(certs.client_key), str(certs.ca))
        with security.channel(f"localhost:{sched_port}", cluster_token="t0k3n", tls=mtls) as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
            assert stats.num_total_blocks > 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def test_scheduler_refuses_an_open_plane_off_loopback():
    done = subprocess.run([sys.executable, "-m", "cli", "scheduler", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, STEPAHEAD_CLUSTER_TOKEN=""))
    assert done.returncode != 0 and "--cluster-token" in done.stderr

