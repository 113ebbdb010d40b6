"""Hostile values against real daemons, each while a long greedy stream runs that must
finish whole and equal Hugging Face (one request must never fail anyone else's work).

Findings covered: the request of death (`top_p = 1e-46` is > 0 as a float64 but 0 in
float32 and crashed every request of the step) and its float32 relatives; values a
gateway-less client sends straight to the scheduler's Connect (NaN temperature,
`top_k = -7`, `top_p = 0`, a token id of 1e6, ...); the waiting-queue bound.
"""

from __future__ import annotations

import grpc
import pytest

from stepahead.v1 import common_pb2, generation_pb2, scheduler_pb2
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.streams import ConnectSession, LongStream


# Sampled requests whose float64 values vanish or degrade in float32; each must run normally.
FLOAT32_EDGES = {
    "top_p 1e-46 (the request of death)": dict(temperature=0.8, top_p=1e-46),
    "top_p float32's smallest subnormal": dict(temperature=0.8, top_p=2.0**-149),
    "top_p just below 1": dict(temperature=0.8, top_p=1 - 1e-12),
    "temperature 1e-46": dict(temperature=1e-46),
    "temperature 5e-324": dict(temperature=5e-324),
    "temperature -0.0": dict(temperature=-0.0),
    "min_p 5e-324": dict(temperature=1.0, min_p=5e-324),
    "min_p 1e-40": dict(temperature=1.0, min_p=1e-40, top_p=1e-30),
}


def test_float32_edge_values_run_and_harm_no_one(serve, hf):
    long = LongStream(serve.gateway)
    for name, fields in FLOAT32_EDGES.items():
        sampling = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True, seed=3, **fields)
        request = generation_pb2.GenerateRequest(text="def f(x):", sampling=sampling)
        messages = list(serve.gateway.Generate(request, timeout=120))
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, (name, messages[-1])
        assert sum(len(m.token_ids) for m in messages) == 8, name
    long.check(hf)


# Submissions a client can send to the scheduler directly, bypassing the gateway.
def _submit(request_id: str, ids=(5, 6, 7), **sampling) -> scheduler_pb2.SubmitRequest:
    sampling.setdefault("max_tokens", 4)
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=list(ids), sampling=common_pb2.SamplingParams(**sampling)
    )


BAD_SUBMISSIONS = {
    "nan-temperature": (dict(temperature=float("nan")), "sampling.temperature"),
    "inf-temperature": (dict(temperature=float("inf")), "sampling.temperature"),
    "top-k-minus-7": (dict(top_k=-7), "sampling.top_k"),
    "top-p-zero": (dict(top_p=0.0), "sampling.top_p"),
    "top-p-nan": (dict(top_p=float("nan")), "sampling.top_p"),
    "min-p-2": (dict(min_p=2.0), "sampling.min_p"),
    "stop-token-1e6": (dict(stop_token_ids=[10**6]), "sampling.stop_token_ids"),
    "min-tokens-over-max": (dict(min_tokens=9), "sampling.min_tokens"),
}


def test_scheduler_revalidates_every_submission(serve, hf):
    long = LongStream(serve.gateway)
    session = ConnectSession(serve.scheduler_channel())
    try:
        for rid, (fields, field) in BAD_SUBMISSIONS.items():
            session.submit(_submit(rid, **fields))
        session.submit(_submit("token-id-1e6", ids=(5, 10**6)))
        session.submit(_submit("priority-5000", ids=(5,)))
        session.submit(scheduler_pb2.SubmitRequest(request_id="priority-5000b", prompt_token_ids=[5], priority=5000))
        session.submit(_submit("good", temperature=0.0, ignore_eos=True))
        expected = {rid: field for rid, (_, field) in BAD_SUBMISSIONS.items()}
        expected.update({"token-id-1e6": "prompt.token_ids", "priority-5000b": "priority"})
        for rid, field in expected.items():
            event = session.last_event(rid)
            assert event.rejected and event.reject_code == scheduler_pb2.REJECT_CODE_INVALID, (rid, event)
            assert field in event.message, (rid, event.message)
        good = session.last_event("good")
        assert good.finish_reason == common_pb2.FINISH_REASON_LENGTH and not good.rejected
    finally:
        session.close()
    long.check(hf)


def test_waiting_queue_is_bounded(tiny_model_dir):  # noqa: F811
    """One running request (max_num_seqs 1) and a queue of 4: the rest of a burst is refused
    with QUEUE_FULL at the scheduler and RESOURCE_EXHAUSTED at the gateway."""
    with Serve(tiny_model_dir, "--max-num-seqs", "1", "--max-queued-requests", "4") as s:
        session = ConnectSession(s.scheduler_channel())
        try:
            session.submit(_submit("q0", temperature=0.0, ignore_eos=True, max_tokens=1500))
            session.first_event("q0")  # q0 runs (max_num_seqs 1) for 1500 steps
            for i in range(1, 12):
                session.submit(_submit(f"q{i}", temperature=0.0, ignore_eos=True, max_tokens=1500))
            for i in range(5, 12):
                event = session.last_event(f"q{i}")
                assert event.rejected and event.reject_code == scheduler_pb2.REJECT_CODE_QUEUE_FULL, event
                assert "--max-queued-requests" in event.message
            # events of one stream come in submission order: q1-q4 would have been refused by now
            assert not any(session.finished(f"q{i}") for i in range(5))
            with pytest.raises(grpc.RpcError) as info:  # the queue is still full: the gateway says so
                list(s.gateway.Generate(generation_pb2.GenerateRequest(text="x"), timeout=60))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queued-requests" in info.value.details()
            stats = s.stats()
            assert stats.num_waiting == 4 and stats.num_running == 1, stats
        finally:
            session.close()
