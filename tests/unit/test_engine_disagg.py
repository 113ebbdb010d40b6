"""Disaggregated prefill/decode through the engine: replicas with roles, requests handed off
with their KV, replicas lost before, during and after a transfer.

The workers are `fake_executor.FakeExecutor`s on threads behind the engine's real links: they
check every position's KV (a request resumed on the decode side before its KV was copied, or
whose source blocks were reused before the copy, computes on wrong KV and fails there), and
their tokens are a hash of the request's tokens, so each stream's tokens, as its gateway
session receives them, are compared with the request's own chain. The engine's log is
captured: a warning it did not announce fails the test.
"""

from __future__ import annotations

import queue
import threading

import structlog
from structlog.testing import capture_logs

from scheduler_service.core.request import Request
from scheduler_service.engine import Engine, PlanOutbox
from scheduler_service.links import GatewaySession, Rejected
from scheduler_service.server import SchedulerDaemonConfig
from stepahead.plan import FinishReason, SamplingParams, WorkerInfo, WorkerRole
from tests.unit.fake_executor import FakeExecutor, hashed_tokens
from tests.unit.test_disagg_core import chain

VOCAB, BLOCK, BLOCKS = 1000, 16, 400
WAIT_S = 30  # room to fail only: every wait returns as soon as its event happens


class FakeWorker:
    """A worker thread: executes each plan, reports its result, and each load it is ordered
    once `hold_loads` lets it (copying from the peer then, or failing when the peer is dead)."""

    def __init__(self, engine: Engine, name: str, role: WorkerRole, peers: dict[str, FakeWorker]) -> None:
        self.name, self.peers, self.dead = name, peers, False
        self.executor = FakeExecutor(BLOCK, BLOCKS, 0, hashed_tokens(VOCAB))
        self.hold_loads = threading.Event()
        self.hold_loads.set()
        self.loads_seen = threading.Event()
        self._lock = threading.Lock()
        address = f"{name}:7000" if role is WorkerRole.PREFILL else ""
        info = WorkerInfo(name, "m", "llama", "bfloat16", "sim", BLOCK, BLOCKS, 0, 4096, VOCAB, (0,), role=role,
                          kv_transfer_address=address)
        accepted = queue.SimpleQueue()
        self.outbox = PlanOutbox(on_accept=lambda: accepted.put(True))
        self.handle = engine.attach_worker(info, self.outbox)
        peers[address or name] = self
        threading.Thread(target=self._run, daemon=True).start()
        assert accepted.get(timeout=WAIT_S)

    def _run(self) -> None:
        for plan in self.outbox:
            with self._lock:
                if self.dead:
                    return
                for load in plan.kv_loads:
                    self.executor.peers[load.source] = self.peers[load.source].executor
                result = self.executor.execute(plan)
                self.executor.mark_reported(plan.step_id)  # sync scheduling: committed before the next plan
            self.handle.on_result(result)
            if plan.kv_loads:
                self.loads_seen.set()
                threading.Thread(target=self._report_loads, args=(plan.kv_loads,), daemon=True).start()

    def _report_loads(self, loads) -> None:
        self.hold_loads.wait()
        for load in loads:
            with self._lock:
                if self.dead:
                    return
                source = self.peers[load.source]
                loaded = self.executor.finish_load(load, "source unreachable" if source.dead else "")
            self.handle.on_kv_loaded(loaded)

    def kill(self) -> None:
        with self._lock:
            self.dead = True
        self.handle.on_lost("killed by the test")


def collect(session: GatewaySession, want: set[str]) -> tuple[dict[str, list[int]], dict[str, object]]:
    """Tokens and finish reasons the session receives, until every request in `want` ended."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, object] = {}
    while not want <= finished.keys():
        for item in session._batches.get(timeout=WAIT_S):
            if isinstance(item, Rejected):
                finished[item.request_id] = item
                continue
            events = [item] if hasattr(item, "new_token_ids") else list(item)
            for event in events:
                assert event.request_id not in finished, f"event after the end: {event}"
                tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
                if event.finish_reason is not None:
                    finished[event.request_id] = event.finish_reason
    return tokens, finished


def start(roles: list[WorkerRole]) -> tuple[Engine, list[FakeWorker]]:
    config = SchedulerDaemonConfig(async_scheduling=False, enable_prefix_caching=True)
    engine = Engine(config.core_config, structlog.get_logger())
    engine.start()
    peers: dict[str, FakeWorker] = {}
    workers = [FakeWorker(engine, f"{role.value}-{i}", role, peers) for i, role in enumerate(roles)]
    return engine, workers


def submit(engine: Engine, n: int, max_tokens: int = 12) -> tuple[GatewaySession, dict]:
    session, specs = GatewaySession(), {}
    for i in range(n):
        prompt = tuple((i * 7 + k) % VOCAB for k in range(40 + 3 * i))  # 3+ blocks each
        specs[f"r{i}"] = prompt
        engine.submit(Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)), session)
    return session, specs


def assert_oracle(tokens: dict, finished: dict, specs: dict, max_tokens: int = 12) -> None:
    for rid, prompt in specs.items():
        assert finished[rid] is FinishReason.LENGTH, (rid, finished[rid])
        assert tokens[rid] == chain(rid, prompt, max_tokens, VOCAB), rid


def pools_settle(engine: Engine) -> None:
    """Every replica's blocks are back and nothing is on record as moving."""
    def check():
        for replica in engine._replicas.values():
            replica.scheduler.check_integrity()
            stats = replica.scheduler.stats()
            assert stats.num_free_blocks == stats.num_total_blocks, (replica.name, stats)
        assert len(engine._transfers) == 0
    engine._call(check, WAIT_S)


def test_prefill_hands_off_to_decode_and_the_stream_is_the_oracle():
    with capture_logs() as logs:
        engine, (prefill, decode) = start([WorkerRole.PREFILL, WorkerRole.DECODE])
        session, specs = submit(engine, 6)
        tokens, finished = collect(session, set(specs))
        assert_oracle(tokens, finished, specs)
        pools_settle(engine)
        stats, per = engine.stats()
        assert stats.num_handoffs == 6 and stats.num_loaded_blocks >= 6 * 3
        assert per["prefill-0"].num_finished == 0 and per["decode-1"].num_finished == 6
        engine.stop()
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs


def test_without_a_decode_replica_the_prefill_replica_serves_requests_whole():
    """Roles are preferences: a lone decode replica takes new prompts (nobody prefills)."""
    engine, (decode,) = start([WorkerRole.DECODE])
    session, specs = submit(engine, 3)
    tokens, finished = collect(session, set(specs))
    assert_oracle(tokens, finished, specs)
    pools_settle(engine)
    engine.stop()


def test_a_prefill_replica_lost_mid_transfer_loses_no_token():
    """Loads are ordered, the prefill worker dies before they copy: they fail, and the decode
    replica computes those requests again; the streams still equal the oracle."""
    with capture_logs() as logs:
        engine, (prefill, decode) = start([WorkerRole.PREFILL, WorkerRole.DECODE])
        decode.hold_loads.clear()
        session, specs = submit(engine, 4)
        assert decode.loads_seen.wait(WAIT_S)
        prefill.kill()
        decode.hold_loads.set()
        tokens, finished = collect(session, set(specs))
        assert_oracle(tokens, finished, specs)
        pools_settle(engine)
        stats, _ = engine.stats()
        assert stats.num_failed_loads >= 1
        engine.stop()
    warned = {e["event"] for e in logs if e["log_level"] in ("warning", "error")}
    assert warned <= {"worker_lost", "kv_load_failed"}, warned
    assert "worker_lost" in warned


def test_a_decode_replica_lost_while_loading_frees_the_source_blocks():
    """Its requests move (recomputed on the other decode replica); the prefill replica's blocks
    they were loading from are given back."""
    with capture_logs() as logs:
        engine, (prefill, decode, other) = start([WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.DECODE])
        decode.hold_loads.clear()
        other.hold_loads.clear()
        session, specs = submit(engine, 6)
        assert decode.loads_seen.wait(WAIT_S)
        decode.kill()
        other.hold_loads.set()
        tokens, finished = collect(session, set(specs))
        assert_oracle(tokens, finished, specs)
        pools_settle(engine)
        engine.stop()
    warned = {e["event"] for e in logs if e["log_level"] in ("warning", "error")}
    assert warned <= {"worker_lost"}, warned
