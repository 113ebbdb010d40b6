"""`--stream-interval N` (vLLM's flag) through the real daemons: the same tokens as the sim
reference, in messages of at least N tokens except a sequence's first and its last."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from stepahead import codec, columns
from stepahead.plan import SamplingParams
from stepahead.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.service.harness import Serve
from tests.service.streams import wait_idle
from tests.sim.test_sim_e2e import to_proto
from worker_service.sim.profiles import load_profile
from worker_service.sim.runner import SimRunner
from worker_service.sim.tokens import reference_output

INTERVAL, SEED = 4, 5


def test_stream_interval_sends_fewer_larger_messages_with_the_same_tokens(sim_model_dir, fast_profile):
    rule = SimRunner(sim_model_dir, load_profile("h200"), num_blocks=64, eos_probability=0.0, seed=SEED).rule
    work = [([5 + i, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=23 + i, ignore_eos=True))
            for i in range(8)]
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", str(fast_profile), "--seed", str(SEED),
               "--sim-eos-probability", "0", "--stream-interval", str(INTERVAL)) as serve:
        with ThreadPoolExecutor(len(work)) as pool:
            replies = list(pool.map(lambda w: list(serve.gateway.Generate(to_proto(*w), timeout=120)), work))
    for (prompt, sampling), messages in zip(work, replies):
        sizes = [len(m.token_ids) for m in messages if m.token_ids]
        assert [t for m in messages for t in m.token_ids] == reference_output(rule, prompt, sampling, 1 << 20)
        # the first message is not held for the interval, but it carries every token that was
        # already queued when the gateway sent it (more than one on a loaded machine)
        assert all(n >= INTERVAL for n in sizes[1:-1]), sizes
        assert len(sizes) <= 2 + sampling.max_tokens // INTERVAL, sizes


def _connect(serve, first: scheduler_pb2.GatewayMessage, submits: list[scheduler_pb2.SubmitRequest]):
    """A raw Connect stream (as a gateway opens it): `first`, then the submissions; the batches."""
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    for msg in [first, *(scheduler_pb2.GatewayMessage(submit=s) for s in submits)]:
        outbox.put(msg)
    channel = serve.scheduler_channel()
    return channel, scheduler_pb2_grpc.SchedulerStub(channel).Connect(iter(outbox.get, None), timeout=120), outbox


def test_a_session_asking_for_it_gets_several_steps_plain_tokens_in_one_batch(sim_model_dir, fast_profile):
    """SessionOptions.plain_token_steps 4: the scheduler holds a session's plain tokens up to 4
    steps; every token still arrives, in order, equal to the sim reference."""
    rule = SimRunner(sim_model_dir, load_profile("h200"), num_blocks=64, eos_probability=0.0, seed=SEED).rule
    work = {f"r{i}": ([5 + i, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=40 + i, ignore_eos=True))
            for i in range(4)}
    submits = [scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt,
                                           sampling=codec.sampling_to_proto(sampling))
               for rid, (prompt, sampling) in work.items()]
    options = scheduler_pb2.GatewayMessage(options=scheduler_pb2.SessionOptions(plain_token_steps=4))
    tokens = {rid: [] for rid in work}
    plain_batches = dict.fromkeys(work, 0)  # batches carrying a request's plain tokens
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", "h200", "--seed", str(SEED),
               "--sim-eos-probability", "0") as serve:
        channel, responses, outbox = _connect(serve, options, submits)
        open_ids = set(work)
        for batch in responses:
            for e in batch.events:
                tokens[e.request_id] += e.token_ids
                if e.finish_reason:
                    open_ids.discard(e.request_id)
            rids = columns.unpack_ids(batch.token_request_ids, "token_request_ids")
            for rid, token in zip(rids, columns.unpack_u32(batch.token_ids, "token_ids")):
                tokens[rid].append(token)
            for rid in set(rids):
                plain_batches[rid] += 1
            if not open_ids:
                break
        outbox.put(None)
        channel.close()
    for rid, (prompt, sampling) in work.items():
        assert tokens[rid] == reference_output(rule, prompt, sampling, 1 << 20), rid
        # ~(max_tokens - 2) / 4 batches when held; one per step (or per merge) when not
        assert plain_batches[rid] <= sampling.max_tokens // 2, (rid, plain_batches[rid])


def test_session_options_out_of_range_are_refused_naming_the_field(sim_model_dir, fast_profile):
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", str(fast_profile)) as serve:
        bad = scheduler_pb2.GatewayMessage(options=scheduler_pb2.SessionOptions(plain_token_steps=5000))
        channel, responses, outbox = _connect(serve, bad, [])
        with pytest.raises(grpc.RpcError) as err:
            next(responses)
        outbox.put(None)
        channel.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "options.plain_token_steps" in err.value.details()


def test_session_options_after_the_first_message_end_the_stream(sim_model_dir, fast_profile):
    work = ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=100_000 - 3, ignore_eos=True))
    with Serve(sim_model_dir, "--device", "sim", "--sim-profile", str(fast_profile), capture_stderr=True) as serve:
        submit = scheduler_pb2.GatewayMessage(submit=scheduler_pb2.SubmitRequest(
            request_id="long", prompt_token_ids=work[0], sampling=codec.sampling_to_proto(work[1])))
        late = scheduler_pb2.GatewayMessage(options=scheduler_pb2.SessionOptions(plain_token_steps=4))
        channel, responses, outbox = _connect(serve, submit, [])
        next(responses)  # the request runs
        outbox.put(late)
        finished = [e for batch in responses for e in batch.events if e.finish_reason]  # the stream ends
        outbox.put(None)
        channel.close()
        wait_idle(serve)  # the abort's blocks come back once the steps in flight are done (fenced)
    assert [(e.request_id, e.finish_reason) for e in finished] == [("long", common_pb2.FINISH_REASON_ABORT)]
    assert serve.log_problems(expected=["gateway_protocol_error"]) == []
