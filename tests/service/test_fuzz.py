"""Fuzz against real daemons while a long greedy stream runs that must finish whole and
equal Hugging Face: every `GenerateRequest` / `SamplingParams` field with extreme values
(denormals, values below float32's smallest subnormal, signed zeros, ±inf, NaN, huge
ints), and random bytes on every public and internal method."""

from __future__ import annotations

import math

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepahead.v1 import common_pb2, generation_pb2, scheduler_pb2
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.streams import LongStream, wait_health

FIELDS = ("request", "model", "request_id", "prompt", "prompt.text", "prompt.token_ids", "stop", "priority") + tuple(
    f"sampling.{f}" for f in common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
)

EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-46, 2.0**-149, 2.0**-126, 1e-5, 0.5, 1 - 1e-12, 1.0, 1.5, 100.0, 1e39,
                  math.inf, -math.inf, math.nan, -1.0]
floats = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(allow_nan=True, allow_subnormal=True))
uint32 = st.one_of(st.integers(0, 8), st.sampled_from([4095, 4096, 2**31, 2**32 - 1]))
int32 = st.one_of(st.integers(-8, 8), st.sampled_from([-(2**31), 2**31 - 1, -1001, 1001, -1000, 1000]))


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        top_k=draw(int32), min_p=draw(floats), min_tokens=draw(uint32),
        stop_token_ids=draw(st.lists(uint32, max_size=3)), ignore_eos=draw(st.booleans()),
        # max_tokens always set and small when valid: the fuzz must stay fast
        max_tokens=draw(st.one_of(st.integers(0, 6), st.sampled_from([2048, 2**32 - 1]))),
    )
    for name, strategy in (("temperature", floats), ("top_p", floats),
                           ("seed", st.integers(-(2**63), 2**63 - 1))):
        if draw(st.booleans()):
            setattr(msg, name, draw(strategy))
    return msg


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=8), st.just("r" * 300))),
        model=draw(st.sampled_from(["", "tiny", "gpt-9"])),
        sampling=draw(sampling_params()),
        stop=draw(st.lists(st.text(max_size=4), max_size=3)),
        include_stop_str_in_output=draw(st.booleans()),
        priority=draw(int32),
    )
    if draw(st.booleans()):
        msg.text = draw(st.text(max_size=40))
    else:
        msg.token_ids.ids.extend(draw(st.lists(uint32, max_size=12)))
    if draw(st.booleans()):
        msg.skip_special_tokens = draw(st.booleans())
    return msg


def check_one(stub, request: generation_pb2.GenerateRequest) -> None:
    """Served normally, or refused with INVALID_ARGUMENT naming a field; nothing else."""
    try:
        messages = list(stub.Generate(request, timeout=120))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details(), request)
        assert exc.details().split(":")[0] in FIELDS, (exc.details(), request)
        return
    last = messages[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH), (last, request)
    assert sum(len(m.token_ids) for m in messages) <= request.sampling.max_tokens


def test_fuzz_every_request_field(serve, hf):
    long = LongStream(serve.gateway, max_tokens=600)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=generate_requests())
    def one(request):
        check_one(serve.gateway, request)

    one()
    long.check(hf)
    stats = serve.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def _methods(channel_target: str, service) -> list[tuple[str, bool, bool]]:
    return [(f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming) for m in service.methods]


def _call_with_bytes(channel, path: str, client_streaming: bool, server_streaming: bool, payload: bytes) -> None:
    """Send raw bytes as the request message; any status is fine, a dead daemon is not."""
    kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = kinds[(client_streaming, server_streaming)](path)  # no (de)serializers: raw bytes
    request = iter([payload, payload[::-1]]) if client_streaming else payload
    try:
        response = call(request, timeout=10)
        if server_streaming:
            next(response, None)  # one message is enough; the rest is cancelled
            response.cancel()
    except grpc.RpcError:
        pass


def test_random_bytes_on_every_method(serve, hf):
    from grpc_health.v1 import health_pb2

    long = LongStream(serve.gateway, max_tokens=600)
    targets = [
        (serve.gateway_addr, generation_pb2.DESCRIPTOR.services_by_name["Generation"]),
        (serve.gateway_addr, health_pb2.DESCRIPTOR.services_by_name["Health"]),
        (serve.scheduler_addr, scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"]),
        (serve.scheduler_addr, health_pb2.DESCRIPTOR.services_by_name["Health"]),
    ]
    # the scheduler's channel carries the cluster token: the bytes get past authentication
    channels = {serve.gateway_addr: grpc.insecure_channel(serve.gateway_addr),
                serve.scheduler_addr: serve.scheduler_channel()}
    methods = [(addr, *m) for addr, service in targets for m in _methods(addr, service)]

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(which=st.integers(0, len(methods) - 1), payload=st.binary(max_size=64))
    def one(which, payload):
        addr, path, cs, ss = methods[which]
        _call_with_bytes(channels[addr], path, cs, ss, payload)

    try:
        one()
        long.check(hf)
        wait_health(serve.gateway_addr, serving=True)
        wait_health(serve.scheduler_addr, serving=True)
        assert serve.proc.poll() is None and len(serve.child_pids()) == 3
    finally:
        for ch in channels.values():
            ch.close()
