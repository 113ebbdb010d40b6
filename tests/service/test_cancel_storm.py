"""Client cancels leave nothing behind in the gateway: a cancel storm in phases (gRPC calls
cancelled after their first message or at once, SSE streams closed after their first
chunk) keeps the gateway's RSS flat across phases, ends with no request open, and the
request structures below both transports (scheduler pool and link routes, the stream gate)
are empty after cancels.

Finding covered: the gateway's memory grew with every client cancel, with no plateau.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import openai

from gateway.admission import StreamGate
from gateway.event_stream import LoopEvents, Mailbox, choices
from gateway.generation import Frontend
from gateway.metrics import GatewayMetrics
from gateway.openai_protocol import CompletionRequest, completion_to_raw
from gateway.scheduler_pool import SchedulerPool
from stepahead.v1 import scheduler_pb2
from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.streams import greedy, wait_active_requests
from tests.unit.test_gateway_frontend import CharTokenizer
from stepahead import codec

PHASES = 4
PER_PHASE = 300  # of each kind
WAVE = 10  # cancels in flight at once
GROWTH_KB_PER_CANCEL = 0.3  # after the first phase (allocator and caches warming up)
SLACK_KB = 1024


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _gateway_pid(serve) -> int:
    (pid,) = [p for p in serve.child_pids() if "gateway" in Path(f"/proc/{p}/cmdline").read_text().split("\0")]
    return pid


def test_a_cancel_storm_keeps_the_gateway_flat(tiny_model_dir):  # noqa: F811
    with Serve(tiny_model_dir, "--max-num-seqs", "64") as serve, \
            openai.OpenAI(base_url=serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        gateway = _gateway_pid(serve)

        def grpc_after_first(i: int) -> None:
            request = greedy([5, 6, 7 + i % 50], 500)
            request.request_id = f"storm-{i}"  # fixed ids: their bookkeeping must go too
            call = serve.gateway.Generate(request, timeout=120)
            next(call)
            call.cancel()

        def grpc_at_once(i: int) -> None:
            serve.gateway.Generate(greedy([5, 6, 7 + i % 50], 500), timeout=120).cancel()

        def sse_after_first(i: int) -> None:
            stream = client.completions.create(model="tiny", prompt=[5, 6, 7 + i % 50], max_tokens=500, stream=True,
                                               extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()

        def storm(offset: int) -> None:
            for kind in (grpc_after_first, grpc_at_once, sse_after_first):
                for start in range(0, PER_PHASE, WAVE):
                    errors: list[BaseException] = []

                    def run(i: int) -> None:
                        try:
                            kind(offset + i)
                        except grpc.RpcError as exc:
                            if exc.code() != grpc.StatusCode.CANCELLED:
                                errors.append(exc)
                        except BaseException as exc:  # the test's failure, below
                            errors.append(exc)

                    threads = [threading.Thread(target=run, args=(start + k,)) for k in range(WAVE)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(120)
                    assert not errors, errors

        rss = []
        for phase in range(PHASES):
            storm(phase * PER_PHASE)
            rss.append(_rss_kb(gateway))
        cancels = 3 * PER_PHASE * (PHASES - 1)
        assert rss[-1] - rss[0] <= SLACK_KB + GROWTH_KB_PER_CANCEL * cancels, rss
        # the last SSE closes reach the gateway as disconnects it handles on its own loop, after
        # the client's close returned: every request leaves the stream count soon, none stays
        metrics = wait_active_requests(serve, 0)
        assert 'stepahead:gateway_usage_mismatch_total{transport="grpc"} 0.0' in metrics


class _Link:
    """A scheduler link that keeps routes like `SchedulerLink` (submit adds, release drops)."""

    def __init__(self):
        self.routes: dict[str, object] = {}
        self.aborted: list[str] = []

    @property
    def num_open(self) -> int:
        return len(self.routes)

    def submit(self, msg, sink):
        if msg.request_id in self.routes:
            raise ValueError("already in flight")
        self.routes[msg.request_id] = sink

    def abort(self, rid):
        self.aborted.append(rid)

    def release(self, rid):
        self.routes.pop(rid, None)


def test_cancelled_consumers_leave_no_route_no_slot_no_pending_event():
    link = _Link()
    pool = SchedulerPool([link], ["s"], log=None)
    gate = StreamGate(1 << 10)
    hello = scheduler_pb2.WorkerHello(model_name="m", max_model_len=64, vocab_size=100)
    front = Frontend(CharTokenizer(), codec.worker_info_from_proto(hello), pool, 1 << 20, GatewayMetrics(), gate)

    async def main():
        loop_events = LoopEvents(asyncio.get_running_loop())

        async def client(i: int, n: int) -> None:
            events = Mailbox()
            gen = front.start(front.validate(completion_to_raw(CompletionRequest(prompt="hi", n=n), 10)),
                              f"r{i % 7}", loop_events.sink(events), "grpc", f"peer:{i}")
            try:
                async for _ in choices(gen, events):
                    pass
            finally:
                gen.abort()  # as both transports do

        for wave in range(20):
            tasks = [asyncio.ensure_future(client(wave * 50 + i, 1 + i % 3)) for i in range(50)]
            await asyncio.sleep(0)  # every consumer waits for its first event
            for rid, sink in list(link.routes.items())[::2]:  # half of them got a token first
                sink(scheduler_pb2.TokenEvent(request_id=rid, token_ids=[1]))
            await asyncio.sleep(0)
            for t in tasks:
                t.cancel()  # the clients go away
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the aborts' wake-ups are flushed
        assert not loop_events._pending

    asyncio.run(main())
    assert pool.num_open == 0 and not pool._routes
    assert not link.routes
    assert gate.active == 0 and front.metrics.registry.get_sample_value("stepahead:gateway_active_requests") == 0
