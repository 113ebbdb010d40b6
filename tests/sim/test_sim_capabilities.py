"""The sim worker (`--device sim`) has no logits: it announces that it computes no logprobs and
supports no structured outputs, and the gateway refuses such requests up front, over HTTP
(400 naming the field, which the `openai` client raises as BadRequestError) and gRPC
(INVALID_ARGUMENT), while plain requests are served."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import openai
import pytest

from stepahead.v1 import common_pb2, generation_pb2
from tests.service.harness import Serve

USER = [{"role": "user", "content": "hi"}]
REFUSED = {  # name -> (path, body, param)
    "completion logprobs": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 1}, "logprobs"),
    "completion echo logprobs": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 0, "echo": True},
                                 "logprobs"),
    "chat logprobs": ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logprobs": True}, "logprobs"),
    "structured choice": ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}},
                          "structured_outputs"),
    "response_format json": ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_object"}},
                             "structured_outputs"),
}


@pytest.fixture(scope="module")
def sim_serve(sim_model_dir, fast_profile):
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", str(fast_profile), "--sim-eos-probability", "0",
               capture_stderr=True) as serve:
        yield serve


def test_the_sim_worker_announces_what_it_cannot_do(sim_serve):
    from stepahead.v1 import scheduler_pb2

    model = sim_serve.scheduler.GetModel(scheduler_pb2.GetModelRequest(), timeout=30)
    assert model.device.startswith("sim") and model.no_logprobs and model.no_structured_outputs, model


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_logprobs_and_structured_outputs_are_refused_with_a_400_naming_the_field(sim_serve, case):
    path, body, param = REFUSED[case]
    response = httpx.post(sim_serve.http_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "sim" in error["message"], error


def test_the_openai_client_raises_bad_request_and_plain_requests_still_work(sim_serve):
    with openai.OpenAI(base_url=sim_serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=2, logprobs=1)
        assert bad.value.param == "logprobs"
        plain = client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=3)
        assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 3


def test_grpc_refuses_them_with_invalid_argument(sim_serve):
    sampling = common_pb2.SamplingParams(max_tokens=2, logprobs=1)
    with pytest.raises(grpc.RpcError) as bad:
        list(sim_serve.gateway.Generate(generation_pb2.GenerateRequest(text="x", sampling=sampling), timeout=60))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in bad.value.details()
