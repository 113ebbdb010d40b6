"""Plain decode tokens on the scheduler → gateway wire (`EventBatch`'s packed columns): what
the scheduler's writer (`scheduler_service/event_batches.py`) encodes from the core's events
and `PlainTokens` columns, the gateway's reader (`gateway/plain_tokens.py`) gives every open
request exactly its events, in order, with the request's prompt / cached counts on its plain
tokens."""

from __future__ import annotations

import contextlib
import functools
import threading
from concurrent import futures

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.grpc_thread import GrpcThread
from gateway.plain_tokens import MalformedBatch, OpenRequest, PlainToken, deliver
from gateway.scheduler_link import LinkBroken, SchedulerLink
from scheduler_service.event_batches import event_batches
from scheduler_service.links import GatewaySession, RejectCode, Rejected
from scheduler_service.core.events import PlainTokens, RequestEvent
from stepahead import codec, columns
from stepahead.logprobs import Logprobs, PromptLogprobs
from stepahead.plan import FinishReason
from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

SCOPE = "2a/"
LP = Logprobs(7, -0.5)


def request_events(rid: str, kinds: list[str], last: str, prompt: int, cached: int, with_prompt_lp: bool) -> list:
    """One request's events as the scheduler makes them: (prompt logprobs,) a first token
    event (queue_time set), middle events of `kinds`, a final one of kind `last`; a core's
    plain token as its one-token `PlainTokens` (`expected` gives the event it stands for)."""
    rid = SCOPE + rid
    out = []
    if with_prompt_lp:  # prompt logprobs computed before the first token: counts 0, like the scheduler's
        out.append(RequestEvent(rid, (), None, prompt, 0, prompt_logprobs=PromptLogprobs(1, (LP,))))
    out.append(RequestEvent(rid, (100,), None, prompt, cached, queue_time=0.01))
    for i, kind in enumerate(kinds):
        token = 101 + i
        out.append({
            "plain": lambda: RequestEvent(rid, (token,), None, prompt, cached),
            "core-plain": lambda: PlainTokens([rid], [token]),  # as update_from_output makes it
            "two": lambda: RequestEvent(rid, (token, token + 1000), None, prompt, cached),
            "logprobs": lambda: RequestEvent(rid, (token,), None, prompt, cached, logprobs=(LP,)),
            "spec": lambda: RequestEvent(rid, (token,), None, prompt, cached, num_draft_tokens=3,
                                         num_accepted_tokens=1, num_spec_steps=2),
        }[kind]())
    out.append({
        "length": RequestEvent(rid, (99,), FinishReason.LENGTH, prompt, cached),
        "error": RequestEvent(rid, (), FinishReason.ERROR, prompt, cached, "worker: row failed"),
        "abort": RequestEvent(rid, (), FinishReason.ABORT, prompt, 0),
        "none": None,  # still running
    }[last])
    return [e for e in out if e is not None]


def expected(item, prompt: int, cached: int) -> RequestEvent:
    """The event a scheduler-side item stands for (a plain token: its request's counts)."""
    if type(item) is PlainTokens:
        (rid,), (token,) = item.request_ids, item.token_ids
        return RequestEvent(rid, (token,), None, prompt, cached)
    return item


def merge_plain(step: list) -> list:
    """Adjacent `PlainTokens` of a step as one, as the engine hands a session a step's share."""
    out: list = []
    for item in step:
        if type(item) is PlainTokens and out and type(out[-1]) is PlainTokens:
            out[-1] = PlainTokens(out[-1].request_ids + item.request_ids, out[-1].token_ids + item.token_ids)
        else:
            out.append(item)
    return out


def fields(e) -> tuple:
    """What the gateway's consumers read of an event (a RequestEvent's on the scheduler side)."""
    if isinstance(e, RequestEvent):
        reason = codec.finish_reason_to_proto(e.finish_reason) if e.finish_reason is not None else 0
        prompt_lp = len(e.prompt_logprobs.entries) if e.prompt_logprobs else 0
        return (tuple(e.new_token_ids), reason, e.num_prompt_tokens, e.num_cached_tokens, e.message, e.rejected,
                len(e.logprobs), prompt_lp, e.num_draft_tokens, e.num_accepted_tokens, e.num_spec_steps)
    return (tuple(e.token_ids), e.finish_reason, e.num_prompt_tokens, e.num_cached_tokens, e.message, e.rejected,
            len(e.logprobs), len(e.prompt_logprobs), e.num_draft_tokens, e.num_accepted_tokens, e.num_spec_steps)


def token_runs(events: list) -> list[tuple]:
    """`fields` of each event, neighbours that differ only in their tokens merged (the gateway
    hands a request's plain tokens of several steps in one batch over as one event)."""
    out: list[tuple] = []
    for f in map(fields, events):
        if out and out[-1][1:] == f[1:] and not f[1] and not f[6]:  # no end, no logprobs: tokens alone
            out[-1] = (out[-1][0] + f[0], *f[1:])
        else:
            out.append(f)
    return out


def decode(wire: list[bytes], open_ids: set[str]) -> dict[str, list]:
    """Every open request's events as the gateway's link hands them to its sink."""
    got: dict[str, list] = {rid: [] for rid in open_ids}
    routes = {rid: OpenRequest(got[rid].append) for rid in open_ids}
    for data in wire:
        deliver(scheduler_pb2.EventBatch.FromString(data), routes)
    return got


requests_st = st.lists(st.tuples(
    st.lists(st.sampled_from(["core-plain", "core-plain", "plain", "two", "logprobs", "spec"]), max_size=8),
    st.sampled_from(["length", "error", "abort", "none"]),
    st.integers(1, 5000), st.integers(0, 4096), st.booleans(), st.booleans(),
), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(requests_st, st.data())
def test_any_merged_steps_decode_to_each_requests_events_in_order(requests, data):
    per_request = {f"r{i}": request_events(f"r{i}", kinds, last, prompt, cached, lp)
                   for i, (kinds, last, prompt, cached, lp, _) in enumerate(requests)}
    want = {f"r{i}": [expected(e, prompt, cached) for e in per_request[f"r{i}"]]
            for i, (_, _, prompt, cached, _, _) in enumerate(requests)}
    per_request["bad"] = [Rejected(SCOPE + "bad", "prompt too long", RejectCode.INVALID)]
    open_ids = {f"r{i}" for i, r in enumerate(requests) if r[5]} | {"bad"}  # the others ended at the gateway
    # interleave the requests' events (each request's in order), cut into steps, steps into merges
    order = data.draw(st.permutations([rid for rid, evs in per_request.items() for _ in evs]))
    cursors = dict.fromkeys(per_request, 0)
    stream = []
    for rid in order:
        stream.append(per_request[rid][cursors[rid]])
        cursors[rid] += 1
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=6)))
    steps = [merge_plain(stream[a:b]) for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=len(steps), max_size=len(steps)))
    session, wire, done = GatewaySession(), [], 0
    merged = iter(session)
    for size in sizes:  # the lists that queued up while the writer was busy, merged by the session
        if done < len(steps):
            for step in steps[done:done + size]:
                session.put_many(step)
            done += size
            wire += [b.SerializeToString() for b in event_batches(next(merged), len(SCOPE))]

    got = decode(wire, open_ids)
    for rid in open_ids - {"bad"}:
        assert token_runs(got[rid]) == token_runs(want[rid]), rid
    (rejected,) = got["bad"]
    assert rejected.rejected and rejected.message == "prompt too long" and rejected.finish_reason


def plain_ids(batch) -> list[str]:
    return columns.unpack_ids(batch.token_request_ids, "token_request_ids")


def plain_tokens(batch) -> list[int]:
    return columns.unpack_u32(batch.token_ids, "token_ids")


def plain(*pairs: tuple[str, int]) -> PlainTokens:
    return PlainTokens([SCOPE + rid for rid, _ in pairs], [token for _, token in pairs])


def test_plain_tokens_go_in_the_columns_and_a_later_event_of_the_same_request_in_the_next_batch():
    first = RequestEvent(SCOPE + "a", (1,), None, 10, 4, queue_time=0.1)
    final = RequestEvent(SCOPE + "a", (4,), FinishReason.LENGTH, 10, 4)
    other = RequestEvent(SCOPE + "b", (9,), FinishReason.STOP, 3, 0)
    one, two = event_batches([first, plain(("a", 2), ("c", 8)), other, plain(("a", 3)), final], len(SCOPE))
    assert [e.request_id for e in one.events] == ["a", "b"], "b's final follows no plain token of b: same batch"
    assert plain_ids(one) == ["a", "c", "a"] and plain_tokens(one) == [2, 8, 3]
    assert [e.request_id for e in two.events] == ["a"] and not two.token_ids, "a's final after a's plain tokens"
    (only,) = event_batches([plain(("a", 2)), plain(("a", 3), ("b", 7))], len(SCOPE))
    assert not only.events and plain_ids(only) == ["a", "a", "b"] and plain_tokens(only) == [2, 3, 7]
    (full,) = event_batches([RequestEvent(SCOPE + "d", (6,), None, 10, 4)], len(SCOPE))
    assert [e.request_id for e in full.events] == ["d"] and not full.token_ids, "only the core's plain tokens pack"
    one, two = event_batches([plain(("c", 5), ("a", 2)), RequestEvent(SCOPE + "c", (6,), FinishReason.STOP, 10, 4)],
                             len(SCOPE))
    assert plain_ids(one) == ["c", "a"] and plain_tokens(one) == [5, 2] and not one.events
    assert [e.request_id for e in two.events] == ["c"], "c's final after c's plain token"


def test_a_plain_token_carries_its_requests_counts_and_ignores_closed_ids():
    batch = scheduler_pb2.EventBatch(token_request_ids=columns.pack_ids(["a", "gone", "a"]),
                                     token_ids=columns.pack_u32([5, 6, 7]))
    batch.events.add(request_id="a", token_ids=[4], num_prompt_tokens=12, num_cached_tokens=8)
    batch.events.add(request_id="a", num_prompt_tokens=12)  # no tokens (e.g. prompt logprobs): counts kept
    got: list = []
    deliver(batch, {"a": OpenRequest(got.append)})
    assert [tuple(e.token_ids) for e in got] == [(4,), (), (5, 7)]  # a's plain tokens: one event, in order
    assert all(isinstance(e, PlainToken) and (e.num_prompt_tokens, e.num_cached_tokens) == (12, 8) for e in got[2:])


def test_columns_of_different_lengths_are_refused_before_anything_is_delivered():
    batch = scheduler_pb2.EventBatch(token_request_ids=columns.pack_ids(["a", "a"]), token_ids=columns.pack_u32([5]))
    batch.events.add(request_id="a", token_ids=[4], num_prompt_tokens=12)
    got: list = []
    with pytest.raises(MalformedBatch, match="token_request_ids has 2 entries but token_ids has 1"):
        deliver(batch, {"a": OpenRequest(got.append)})
    assert got == []


def test_packed_columns_that_do_not_decode_are_refused_before_anything_is_delivered():
    for ids, tokens, match in ((b"a", columns.pack_u32([5]), "not NUL-terminated"),
                               (b"\xff\0", columns.pack_u32([5]), "not UTF-8"),
                               (columns.pack_ids(["a"]), b"\5\0\0", "not a whole number of uint32")):
        batch = scheduler_pb2.EventBatch(token_request_ids=ids, token_ids=tokens)
        batch.events.add(request_id="a", token_ids=[4], num_prompt_tokens=12)
        got: list = []
        with pytest.raises(MalformedBatch, match=match):
            deliver(batch, {"a": OpenRequest(got.append)})
        assert got == []


def test_the_scope_is_cut_from_every_plain_id_even_of_mixed_scopes():
    from scheduler_service.event_batches import event_batches

    (one,) = event_batches([PlainTokens(["2a/x", "2a/2a/y"], [1, 2])], len(SCOPE))
    assert plain_ids(one) == ["x", "2a/y"], "only the leading scope goes"
    (mixed,) = event_batches([PlainTokens(["2a/x", "3b/y"], [1, 2])], len(SCOPE))  # never from the engine
    assert plain_ids(mixed) == ["x", "y"]


class _Malformed(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler that answers the first submission with a batch whose columns differ in length."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def Connect(self, request_iterator, context):
        context.add_callback(self.cancelled.set)
        msg = next(request_iterator)
        batch = scheduler_pb2.EventBatch(token_request_ids=columns.pack_ids([msg.submit.request_id] * 2),
                                         token_ids=columns.pack_u32([1]))
        batch.events.add(request_id=msg.submit.request_id, token_ids=[3], num_prompt_tokens=2)
        yield batch
        self.cancelled.wait(30)


class _Log:
    def __init__(self) -> None:
        self.warnings: list[dict] = []

    def warning(self, event: str, **kw) -> None:
        self.warnings.append({"event": event, **kw})


def test_a_malformed_batch_breaks_the_link_for_its_requests_and_cancels_the_stream():
    servicer = _Malformed()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log, got, ended = _Log(), [], threading.Event()

    def sink(event) -> None:
        got.append(event)
        if isinstance(event, LinkBroken):
            ended.set()

    loop = GrpcThread()
    try:
        link = SchedulerLink(lambda: grpc.aio.insecure_channel(f"127.0.0.1:{port}"), loop.loop, log)
        link.submit(scheduler_pb2.SubmitRequest(request_id="x", prompt_token_ids=[1, 2]), sink)
        assert ended.wait(30), "the request never learned that its stream broke"
        assert servicer.cancelled.wait(30), "the stream to the scheduler was not cancelled"
        link.close()
    finally:
        loop.stop()
        server.stop(None)
    assert len(got) == 1 and isinstance(got[0], LinkBroken), "nothing of the malformed batch is delivered"
    assert "token_request_ids has 2 entries but token_ids has 1" in str(got[0])
    assert log.warnings[0]["event"] == "scheduler_link_broken" and log.warnings[0]["open_requests"] == 1


class _Scripted(scheduler_pb2_grpc.SchedulerServicer):
    """Two schedulers' behaviour, by submission: the first answers a first token and a plain
    one, then its stream fails; the second (the continuation, prompt + 2 streamed tokens)
    answers its own first event (6 prompt tokens, 5 cached), plain tokens, and the end."""

    def __init__(self) -> None:
        self.submissions: list[scheduler_pb2.SubmitRequest] = []
        self.lock = threading.Lock()

    def Connect(self, request_iterator, context):
        msg = next(request_iterator).submit
        with self.lock:
            self.submissions.append(msg)
            first = len(self.submissions) == 1
        rid, n = msg.request_id, len(msg.prompt_token_ids)
        batch = scheduler_pb2.EventBatch()
        if first:
            batch.events.add(request_id=rid, token_ids=[10], num_prompt_tokens=n, num_cached_tokens=0)
            batch.token_request_ids, batch.token_ids = columns.pack_ids([rid]), columns.pack_u32([11])
            yield batch
            context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler lost")
        batch.events.add(request_id=rid, token_ids=[12], num_prompt_tokens=n, num_cached_tokens=5)
        batch.token_request_ids, batch.token_ids = columns.pack_ids([rid, rid]), columns.pack_u32([13, 14])
        yield batch
        end = scheduler_pb2.EventBatch()
        end.events.add(request_id=rid, token_ids=[15], num_prompt_tokens=n, num_cached_tokens=5, finish_reason=2)
        yield end


@contextlib.contextmanager
def _pool_over(servicers: list, names: list[str], **pool_kw):
    """A `SchedulerPool` (with its links and log) over a started gRPC server per scripted
    scheduler servicer, on a gRPC loop thread; everything stopped on exit."""
    from gateway.scheduler_pool import SchedulerPool

    servers, targets = [], []
    for servicer in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
        targets.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    loop, log = GrpcThread(), _Log()
    try:
        links = [SchedulerLink(functools.partial(grpc.aio.insecure_channel, t), loop.loop, log) for t in targets]
        pool = SchedulerPool(links, names, log, **pool_kw)
        yield pool, links, log
        pool.close()
    finally:
        loop.stop()
        for server in servers:
            server.stop(None)


def test_after_failover_plain_tokens_report_the_clients_prompt_and_the_new_schedulers_cache():
    servicer = _Scripted()
    got, ended = [], threading.Event()

    def sink(event) -> None:
        got.append(event)
        if event.finish_reason or isinstance(event, LinkBroken):
            ended.set()

    with _pool_over([servicer, servicer], ["s0", "s1"], failover_timeout_s=30) as (pool, _, _):
        pool.submit(scheduler_pb2.SubmitRequest(request_id="x", prompt_token_ids=[1, 2, 3, 4]), sink)
        assert ended.wait(30), "the request never finished"
        pool.release("x")
    assert [list(s.prompt_token_ids) for s in servicer.submissions] == [[1, 2, 3, 4], [1, 2, 3, 4, 10, 11]]
    # the new scheduler's two plain tokens in one batch reach the sink as one event
    assert [tuple(e.token_ids) for e in got] == [(10,), (11,), (12,), (13, 14), (15,)]
    assert [(e.num_prompt_tokens, e.num_cached_tokens) for e in got] == [(4, 0)] * 2 + [(4, 5)] * 3
    full, packed = scheduler_pb2.TokenEvent, PlainToken
    assert [type(e) for e in got] == [full, packed, full, packed, full]


class _LosesTheFirstStream(scheduler_pb2_grpc.SchedulerServicer):
    """The gateway's only scheduler: its first stream breaks once `count` requests are in;
    later streams answer each submission with a finished token event."""

    def __init__(self, count: int) -> None:
        self.count, self.connects = count, 0

    def Connect(self, request_iterator, context):
        self.connects += 1
        if self.connects == 1:
            for n, _ in enumerate(request_iterator, 1):
                if n == self.count:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler restarting")
        for msg in request_iterator:
            if msg.HasField("submit"):
                batch = scheduler_pb2.EventBatch()
                batch.events.add(request_id=msg.submit.request_id, token_ids=[7], num_prompt_tokens=1,
                                 finish_reason=2)
                yield batch


class _ThreadLog(_Log):
    def warning(self, event: str, **kw) -> None:
        super().warning(event, thread=threading.current_thread().name, **kw)


def test_while_every_scheduler_is_down_resubmissions_wait_on_the_loop_not_a_thread_each():
    """With one scheduler, its restart leaves every open request waiting for it to come back:
    each waits in a timer of the links' loop. It used to be a `threading.Timer` each (a thread
    per open request at once, again at every backoff step, under a thousand streams), and each
    resubmission logged a warning line of its own; now they are counted and logged once."""
    from gateway.scheduler_pool import SchedulerPool

    count = 40
    servicer = _LosesTheFirstStream(count)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log, finished, done = _ThreadLog(), set(), threading.Event()

    def sink(event) -> None:
        assert not isinstance(event, LinkBroken), event
        if event.finish_reason:
            finished.add(event.request_id)
            if len(finished) == count:
                done.set()

    loop = GrpcThread()
    try:
        link = SchedulerLink(functools.partial(grpc.aio.insecure_channel, f"127.0.0.1:{port}"), loop.loop, log)
        counted = []
        pool = SchedulerPool([link], ["s0"], log, failover_timeout_s=60,
                             on_resubmit=lambda s: counted.append((s, threading.current_thread().name)))
        for i in range(count):
            pool.submit(scheduler_pb2.SubmitRequest(request_id=f"r{i}", prompt_token_ids=[1, 2]), sink)
        assert done.wait(60), f"{len(finished)} of {count} requests finished"
        pool.close()
    finally:
        loop.stop()
        server.stop(None)
    assert counted == [("s0", "grpc-aio")] * count and servicer.connects == 2  # on the links' loop, no thread each
    resubmitted = [w for w in log.warnings if w["event"] == "request_resubmitted"]
    assert len(resubmitted) == 1 and resubmitted[0]["thread"] == "grpc-aio"  # one line for the lot


class _Echo(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler that answers each submission with one token event and each abort with
    nothing, and keeps the stream open until the client ends it."""

    def __init__(self) -> None:
        self.messages: list[scheduler_pb2.GatewayMessage] = []
        self.ended = threading.Event()

    def Connect(self, request_iterator, context):
        context.add_callback(self.ended.set)
        for msg in request_iterator:
            self.messages.append(msg)
            if msg.HasField("submit"):
                batch = scheduler_pb2.EventBatch()
                batch.events.add(request_id=msg.submit.request_id, token_ids=[7], num_prompt_tokens=1)
                yield batch


def test_the_link_runs_on_its_loop_takes_calls_from_any_thread_and_closes_without_a_warning():
    """Events reach the sinks on the link's event loop whichever thread submitted; an abort
    follows its submission on the stream; closing the link ends the open requests with
    `LinkBroken` and logs nothing (a normal shutdown)."""
    servicer = _Echo()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log, got, seen = _Log(), [], {"a": threading.Event(), "b": threading.Event()}
    loop = GrpcThread()

    def sink(event) -> None:
        got.append((threading.current_thread().name, event))
        if not isinstance(event, LinkBroken):
            seen[event.request_id].set()

    try:
        link = SchedulerLink(lambda: grpc.aio.insecure_channel(f"127.0.0.1:{port}"), loop.loop, log,
                             plain_token_steps=4, metadata=(("x-note", "1"),))
        link.submit(scheduler_pb2.SubmitRequest(request_id="a", prompt_token_ids=[1]), sink)  # not the loop's thread
        assert seen["a"].wait(30), "no event reached the sink"
        link.abort("a")
        link.release("a")  # before the loop sent the abort: it still goes out
        link.submit(scheduler_pb2.SubmitRequest(request_id="b", prompt_token_ids=[1]), sink)
        assert seen["b"].wait(30), "no event reached the sink"
        assert link.num_open == 1
        link.close()
        assert servicer.ended.wait(30), "closing the link did not end the stream"
    finally:
        loop.stop()
        server.stop(None)
    assert [(name, type(e).__name__) for name, e in got] == [("grpc-aio", "TokenEvent")] * 2 + [
        ("grpc-aio", "LinkBroken")]
    kinds = [(m.WhichOneof("kind"), getattr(getattr(m, m.WhichOneof("kind")), "request_id", ""))
             for m in servicer.messages]
    assert kinds == [("options", ""), ("submit", "a"), ("abort", "a"), ("submit", "b")], kinds
    assert servicer.messages[0].options.plain_token_steps == 4
    assert log.warnings == [], "a normal shutdown logs no warning"


class _NoWorkerYet(scheduler_pb2_grpc.SchedulerServicer):
    """A fresh scheduler (restarted, no worker re-attached yet): it refuses every submission
    as UNAVAILABLE, as the real one does before its first worker attaches."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def Connect(self, request_iterator, context):
        for msg in request_iterator:
            if msg.HasField("submit"):
                self.refused.append(msg.submit.request_id)
                batch = scheduler_pb2.EventBatch()
                batch.events.add(request_id=msg.submit.request_id, rejected=True, message="no worker attached yet",
                                 reject_code=scheduler_pb2.REJECT_CODE_UNAVAILABLE)
                yield batch


class _Answers(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler with a worker: each submission gets one finished token event."""

    def Connect(self, request_iterator, context):
        for msg in request_iterator:
            if msg.HasField("submit"):
                batch = scheduler_pb2.EventBatch()
                batch.events.add(request_id=msg.submit.request_id, token_ids=[7], num_prompt_tokens=1, finish_reason=2)
                yield batch


def test_a_scheduler_without_a_worker_yet_passes_its_requests_to_another():
    """After a scheduler's restart the gateways reconnect before its workers re-attach, and the
    prompts it is the affinity choice for were refused UNAVAILABLE to the client (a `--slow`
    chaos run lost requests so) while another scheduler could serve them. Now they move on as
    in a failover; with no other scheduler the client gets the refusal, as before."""
    from gateway.scheduler_pool import SchedulerPool

    fresh, serving = _NoWorkerYet(), _Answers()
    count, got, lock, done = 24, {}, threading.Lock(), threading.Event()

    def sink(event) -> None:
        with lock:
            got[event.request_id] = event
            if len(got) == count:
                done.set()

    with _pool_over([fresh, serving], ["fresh", "serving"], failover_timeout_s=30) as (pool, links, log):
        for i in range(count):  # prompts that rendezvous hashing spreads over both
            pool.submit(scheduler_pb2.SubmitRequest(request_id=f"r{i}", prompt_token_ids=[i, 2 * i + 1]), sink)
        assert done.wait(30), f"{len(got)} of {count} requests ended"
        for i in range(count):
            pool.release(f"r{i}")
        alone = SchedulerPool(links[:1], ["fresh"], log)
        refused = threading.Event()
        alone.submit(scheduler_pb2.SubmitRequest(request_id="only", prompt_token_ids=[1]),
                     lambda e: refused.set() if e.rejected else None)
        assert refused.wait(30), "with one scheduler the refusal reaches the client"
    assert fresh.refused, "no prompt went to the fresh scheduler first: the test proves nothing"
    assert all(e.finish_reason == 2 and not e.rejected for e in got.values()), \
        [e for e in got.values() if e.rejected][:3]
