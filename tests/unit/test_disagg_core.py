"""Disaggregated prefill/decode in the scheduler core: a prefill core hands each request off
after its first token, a decode core loads its KV and continues it (`Scheduler.take_handoffs`,
`add_transferred`, `kv_loaded`, `take_released_sources`, `release_handoff`), glued as the
engine glues them (`transfers.Transfers`).

Two fake workers (`fake_executor.FakeExecutor`) check the KV position by position: a load
copies the source blocks only when it is reported, so a source block the prefill core reused
before the decode side released it, a destination block a plan touched while loading, or a
request resumed before its KV arrived all show up as wrong KV. Interleavings, failed loads and
aborts are drawn by hypothesis; every output equals the request's own token chain (the fake's
tokens are a hash of the request's tokens: the oracle), and both cores pass
`check_integrity` after every action.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import FinishReason
from scheduler_service.transfers import Transfers
from stepahead.plan import SamplingParams, WorkerRole
from tests.unit.fake_executor import Driver, hashed_tokens

VOCAB = 50
SOURCE = "prefill-0:7000"


def config(role: WorkerRole, blocks: int, **kw) -> SchedulerConfig:
    base = dict(num_gpu_blocks=blocks, max_model_len=96, block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                enable_chunked_prefill=True, enable_prefix_caching=True, vocab_size=VOCAB, role=role)
    return SchedulerConfig(**{**base, **kw})


def chain(rid: str, prompt: tuple[int, ...], n: int) -> list[int]:
    """The oracle: the fake's tokens for a request alone."""
    token_fn, tokens, out = hashed_tokens(VOCAB), list(prompt), []
    for _ in range(n):
        out.append(token_fn(rid, tuple(tokens)))
        tokens.append(out[-1])
    return out


class Pair:
    """A prefill driver and a decode driver, glued as the engine glues them."""

    def __init__(self, rng: random.Random, prefill_blocks: int, decode_blocks: int, async_scheduling: bool) -> None:
        token_fn = hashed_tokens(VOCAB)
        self.rng = rng
        self.prefill = Driver.create(config(WorkerRole.PREFILL, prefill_blocks, async_scheduling=async_scheduling),
                                     token_fn)
        self.decode = Driver.create(config(WorkerRole.DECODE, decode_blocks, async_scheduling=async_scheduling),
                                    token_fn)
        self.decode.executor.peers[SOURCE] = self.prefill.executor
        self.transfers = Transfers()
        self.owner: dict[str, Driver] = {}

    def add(self, rid: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        from scheduler_service.core.request import Request

        self.prefill.scheduler.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
        self.owner[rid] = self.prefill

    def move_handoffs(self) -> None:
        for handoff in self.prefill.scheduler.take_handoffs():
            rid = handoff.request.request_id
            tid = self.transfers.start("prefill", rid)
            self.decode.scheduler.add_transferred(handoff.request, SOURCE, handoff.block_ids, tid)
            self.owner[rid] = self.decode

    def release_sources(self) -> None:
        for _, rid in self.transfers.end(self.decode.scheduler.take_released_sources()):
            self.prefill.scheduler.release_handoff(rid)

    def act(self, fail_rate: float, abort_rate: float) -> bool:
        """One random action that can happen; False when nothing can."""
        self.fail_rate = fail_rate
        actions = []
        for d in (self.prefill, self.decode):
            if d.scheduler.can_schedule():
                actions.append(("step", d))
            if d.results:
                actions.append(("deliver", d))
        if self.decode.executor.pending_loads:
            actions.append(("load", None))
        live = [rid for rid, d in self.owner.items() if d.scheduler.get_request(rid) is not None]
        if live and self.rng.random() < abort_rate:
            actions.append(("abort", self.rng.choice(live)))
        self.rng.shuffle(actions)
        for kind, arg in actions:
            if self._do(kind, arg):
                break
        else:
            return False
        self.release_sources()
        self.prefill.scheduler.check_integrity()
        self.decode.scheduler.check_integrity()
        return True

    def _do(self, kind: str, arg) -> bool:
        if kind == "step":
            return arg.step()
        if kind == "deliver":
            arg.deliver()
            if arg is self.prefill:
                self.move_handoffs()
        elif kind == "load":
            load = self.rng.choice(self.decode.executor.pending_loads)
            error = "source unreachable" if self.rng.random() < self.fail_rate else ""
            self.decode.scheduler.kv_loaded(self.decode.executor.finish_load(load, error))
        else:
            self.owner[arg].abort(arg)
        return True

    def busy(self) -> bool:
        return bool(self.prefill.scheduler.has_unfinished_requests() or self.decode.scheduler.has_unfinished_requests()
                    or self.prefill.results or self.decode.results or self.decode.executor.pending_loads)


def run(seed: int, fail_rate: float, abort_rate: float, async_scheduling: bool = True,
        prefill_blocks: int = 40, decode_blocks: int = 40) -> tuple[Pair, dict]:
    rng = random.Random(seed)
    pair = Pair(rng, prefill_blocks, decode_blocks, async_scheduling)
    shared = tuple(rng.randrange(VOCAB) for _ in range(8))  # two full blocks some prompts share
    specs = {}
    for i in range(rng.randint(1, 8)):
        own = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 14)))
        prompt = shared + own if rng.random() < 0.5 else own
        specs[f"r{i}"] = (prompt, rng.randint(1, 12))
    pending = list(specs.items())
    for _ in range(20_000):
        if pending and rng.random() < 0.3:
            rid, (prompt, n) = pending.pop(0)
            pair.add(rid, prompt, n)
        if not pair.act(fail_rate, abort_rate) and not pending:
            break
        if not pending and not pair.busy():
            break
    else:
        raise AssertionError("the pair never finished")
    assert not pair.busy(), "requests left unfinished with nothing to do"
    return pair, specs


def check_outputs(pair: Pair, specs: dict) -> None:
    for rid, (prompt, n) in specs.items():
        got = pair.prefill.outputs.get(rid, []) + pair.decode.outputs.get(rid, [])
        reason = pair.decode.finished.get(rid) or pair.prefill.finished.get(rid)
        want = chain(rid, prompt, n)
        if reason is FinishReason.ABORT:
            assert got == want[:len(got)], rid
        else:
            assert (got, reason) == (want, FinishReason.LENGTH), rid


def check_pools_empty(pair: Pair) -> None:
    """Every block back: nothing held for a hand-off, nothing loading."""
    for d in (pair.prefill, pair.decode):
        stats = d.scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, stats
        assert stats.num_loading == 0
    assert len(pair.transfers) == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_handoffs_load_and_continue_with_the_oracle_tokens(seed, async_scheduling):
    pair, specs = run(seed, fail_rate=0.0, abort_rate=0.0, async_scheduling=async_scheduling)
    check_outputs(pair, specs)
    check_pools_empty(pair)
    stats = pair.decode.scheduler.stats()
    handed = sum(n > 1 for _, n in specs.values())
    assert pair.prefill.scheduler.stats().num_handoffs == handed
    assert pair.decode.scheduler.stats().num_finished == handed
    # every request sampled exactly one token on the prefill side
    assert all(len(pair.prefill.outputs.get(rid, [])) == 1 for rid in specs)
    assert stats.num_failed_loads == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_failed_loads_and_aborts_lose_nothing_and_leak_no_block(seed):
    pair, specs = run(seed, fail_rate=0.3, abort_rate=0.05)
    check_outputs(pair, specs)
    check_pools_empty(pair)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_small_decode_pool_makes_handoffs_wait_not_fail(seed):
    """Decode blocks for about one request: the others wait in its queue, their source
    blocks held, and still finish."""
    pair, specs = run(seed, fail_rate=0.0, abort_rate=0.0, decode_blocks=10, prefill_blocks=60)
    check_outputs(pair, specs)
    check_pools_empty(pair)


def test_a_full_prefix_hit_on_the_decode_side_loads_nothing():
    pair = Pair(random.Random(0), 40, 40, async_scheduling=False)
    prompt = tuple(range(1, 9))  # two full blocks: the decode core caches both after the first request
    for rid in ("a", "b"):
        pair.add(rid, prompt, 3)
        while pair.busy():
            assert pair.act(0.0, 0.0)
    assert pair.decode.scheduler.stats().num_loaded_blocks == 2  # only a's; b's are the cached ones
    check_outputs(pair, {"a": (prompt, 3), "b": (prompt, 3)})
    check_pools_empty(pair)


def test_a_load_report_for_an_unknown_transfer_is_refused():
    from stepahead.plan import KVLoaded

    pair = Pair(random.Random(0), 40, 40, async_scheduling=True)
    try:
        pair.decode.scheduler.kv_loaded(KVLoaded(99))
    except ValueError as exc:
        assert "transfer 99" in str(exc)
    else:
        raise AssertionError("an unknown transfer was accepted")
