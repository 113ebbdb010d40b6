"""A fake worker that executes StepPlans exactly as the plan docstring says, checking the
scheduler's side of the contract, plus a driver that runs scheduler + fake in a loop.

The fake keeps a KV "cache" whose slots hold (position, token) instead of tensors: every
step it writes the computed slots and then verifies that every position the request
attends to holds the right token. A wrong prefix hit, a bad swap, a short block table or a
block reused under another request all fail there. Sampled tokens are a hash of the
request id and all its known tokens (deterministic, batch-independent), so a run can be
compared with an uncontended synchronous run of the same request.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.events import RequestEvent
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.step_loop import StepLoop
from stepahead.plan import SamplingParams, SpecOutcome, StepPlan, StepResult

TokenFn = Callable[[str, tuple[int, ...]], int]


def hashed_tokens(vocab_size: int) -> TokenFn:
    """token = crc32(request id, all known tokens) mod vocab_size."""

    def token_fn(request_id: str, tokens: tuple[int, ...]) -> int:
        return zlib.crc32(request_id.encode() + array("q", tokens).tobytes()) % vocab_size

    return token_fn


def eos_at(eos_token_id: int, lengths: Mapping[str, int], base: TokenFn) -> TokenFn:
    """Sample `eos_token_id` as the token that makes a request `lengths[request_id]` long."""

    def token_fn(request_id: str, tokens: tuple[int, ...]) -> int:
        if lengths.get(request_id) == len(tokens) + 1:
            return eos_token_id
        return base(request_id, tokens)

    return token_fn


@dataclass
class _WorkerRequest:
    tokens: list[int]
    sampled_by: list[int]  # per position: step that sampled it, -1 if given in NewRequest
    block_table: list[int]
    num_computed: int


@dataclass
class FakeExecutor:
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    token_fn: TokenFn
    requests: dict[str, _WorkerRequest] = field(default_factory=dict)
    reported_step: int = -1  # newest step whose result the scheduler has processed
    next_step: int = 0
    _touched: dict[int, tuple[set[int], set[int]]] = field(default_factory=dict)
    # speculative decoding: drafts proposed and accepted at random (a prefix of the true
    # continuation, so the tokens equal a run without speculation); None: propose nothing
    spec_rng: random.Random | None = None
    # every layer's sliding window (0: none): a query at p reads the keys p - window < k <= p
    # only, so a block the window passed may be reused under another request
    window: int = 0
    # disaggregation: the other fakes by transfer address, and this one's loads ordered but
    # not yet reported (`finish_load` copies the source blocks then: a source block reused
    # before the scheduler released it shows up as wrong KV here)
    peers: dict[str, FakeExecutor] = field(default_factory=dict)
    pending_loads: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = [[None] * self.block_size for _ in range(self.num_gpu_blocks)]
        self.host = [[None] * self.block_size for _ in range(self.num_cpu_blocks)]

    def mark_reported(self, step_id: int) -> None:
        assert step_id == self.reported_step + 1
        self.reported_step = step_id
        self._touched.pop(step_id, None)

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step_id == self.next_step, f"plan {plan.step_id} out of order"
        self._check_fences(plan)
        for rid in plan.finished_ids + plan.preempted_ids:
            assert rid in self.requests, f"forgetting unknown request {rid}"
            del self.requests[rid]
        for dev, host in plan.swap_out:
            self.host[host] = list(self.kv[dev])
        for host, dev in plan.swap_in:
            self.kv[dev] = list(self.host[host])
        for load in plan.kv_loads:
            assert load.source in self.peers, f"load from unknown source {load.source}"
            assert len(load.src_block_ids) == len(load.dst_block_ids)
            for dev in load.dst_block_ids:
                self.kv[dev] = [None] * self.block_size  # garbage until the load is reported
            self.pending_loads.append(load)
        scheduled: list[tuple[str, int, bool, int]] = []
        for nr in plan.new_requests:
            assert nr.request_id not in self.requests, f"{nr.request_id} registered twice"
            assert 0 <= nr.num_computed_tokens < len(nr.token_ids)
            self.requests[nr.request_id] = _WorkerRequest(
                list(nr.token_ids), [-1] * len(nr.token_ids), list(nr.block_ids), nr.num_computed_tokens
            )
            scheduled.append((nr.request_id, nr.num_scheduled_tokens, False, 0))
        for rr in plan.running:
            self.requests[rr.request_id].block_table.extend(rr.new_block_ids)
            scheduled.append((rr.request_id, rr.num_scheduled_tokens, rr.input_is_placeholder, rr.num_draft_tokens))
        ids = [rid for rid, *_ in scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one plan"
        starts = {rid: self.requests[rid].num_computed for rid in ids}
        sampled, spec = {}, {}
        for rid, n, placeholder, drafts in scheduled:
            if drafts:
                sampled[rid], spec[rid] = self._speculate(rid, n, placeholder, drafts, plan.step_id)
                continue
            token = self._compute(rid, n, placeholder, plan.step_id)
            if token is not None:
                sampled[rid] = token
        self._record_touched(plan, starts)
        self.next_step += 1
        return StepResult(plan.step_id, sampled, speculation=spec)

    def _speculate(self, rid: str, n: int, placeholder: bool, allowed: int, step_id: int) -> tuple[int, SpecOutcome]:
        """A speculative decode: input = the last known token; k <= allowed drafts, a <= k accepted."""
        req, bs = self.requests[rid], self.block_size
        start = req.num_computed
        assert n == allowed + 1 and start + 1 == len(req.tokens), f"{rid}: drafts allowed on a non-decode"
        assert len(req.block_table) * bs >= start + n, f"{rid}: blocks not reserved for the worst case"
        unreported = req.sampled_by[start] > self.reported_step
        assert placeholder == unreported, f"{rid}: input_is_placeholder={placeholder}, token unreported={unreported}"
        assert not placeholder or req.sampled_by[start] == step_id - 1, \
            f"{rid}: placeholder input sampled by step {req.sampled_by[start]}, not the previous one ({step_id - 1})"
        rng = self.spec_rng or random.Random(0)
        k = rng.randint(0, allowed) if self.spec_rng else 0
        a = rng.randint(0, k)
        true, toks = [], list(req.tokens)
        for _ in range(k + 1):
            true.append(self.token_fn(rid, tuple(toks)))
            toks.append(true[-1])
        drafts = true[:a] + [true[a] + 1] * (k - a)  # the first rejected draft differs from the truth
        for i, tok in enumerate([req.tokens[start], *drafts]):
            p = start + i
            self.kv[req.block_table[p // bs]][p % bs] = (p, tok)
        for q in range(self._first_key(start), start + 1):
            got = self.kv[req.block_table[q // bs]][q % bs]
            assert got == (q, req.tokens[q]), f"{rid}: KV at position {q} holds {got}, want {(q, req.tokens[q])}"
        req.tokens += true[: a + 1]
        req.sampled_by += [step_id] * (a + 1)
        req.num_computed = start + 1 + a
        return true[a], SpecOutcome(k, tuple(true[:a]))

    def _compute(self, rid: str, n: int, placeholder: bool, step_id: int) -> int | None:
        req, bs = self.requests[rid], self.block_size
        start, end = req.num_computed, req.num_computed + n
        assert n > 0 and end <= len(req.tokens), f"{rid}: computes [{start}, {end}) of {len(req.tokens)} known"
        assert len(req.block_table) * bs >= end, f"{rid}: block table too short for {end} tokens"
        unreported = req.sampled_by[start] > self.reported_step
        assert placeholder == unreported, f"{rid}: input_is_placeholder={placeholder}, token unreported={unreported}"
        assert not placeholder or req.sampled_by[start] == step_id - 1, \
            f"{rid}: placeholder input sampled by step {req.sampled_by[start]}, not the previous one ({step_id - 1})"
        for p in range(start, end):
            self.kv[req.block_table[p // bs]][p % bs] = (p, req.tokens[p])
        for q in range(self._first_key(start), end):
            got = self.kv[req.block_table[q // bs]][q % bs]
            assert got == (q, req.tokens[q]), f"{rid}: KV at position {q} holds {got}, want {(q, req.tokens[q])}"
        req.num_computed = end
        if end < len(req.tokens):
            return None
        token = self.token_fn(rid, tuple(req.tokens))
        req.tokens.append(token)
        req.sampled_by.append(step_id)
        return token

    def finish_load(self, load, error: str = ""):
        """End a pending load: copy its blocks from the source now (unless it fails)."""
        from stepahead.plan import KVLoaded

        self.pending_loads.remove(load)
        if not error:
            peer = self.peers[load.source]
            for src, dst in zip(load.src_block_ids, load.dst_block_ids):
                self.kv[dst] = list(peer.kv[src])
        return KVLoaded(load.transfer_id, error)

    def _check_fences(self, plan: StepPlan) -> None:
        """Blocks handed out fresh must not be touched by a plan still in flight."""
        bs = self.block_size
        fresh = {dev for _, dev in plan.swap_in}
        for nr in plan.new_requests:
            fresh.update(nr.block_ids[nr.num_computed_tokens // bs :])
        for rr in plan.running:
            fresh.update(rr.new_block_ids)
        for load in plan.kv_loads:
            fresh.update(load.dst_block_ids)
        fresh_host = {host for _, host in plan.swap_out}
        for step, (device, host) in self._touched.items():
            assert not fresh & device, f"plan {plan.step_id} reuses blocks {fresh & device} of in-flight plan {step}"
            assert not fresh_host & host, f"plan {plan.step_id} reuses host blocks of in-flight plan {step}"

    def _first_key(self, start: int) -> int:
        """The first position a step computing from `start` on reads."""
        return max(0, start - self.window + 1) if self.window else 0

    def _record_touched(self, plan: StepPlan, starts: Mapping[str, int]) -> None:
        device = {dev for dev, _ in plan.swap_out} | {dev for _, dev in plan.swap_in}
        for rid, start in starts.items():
            if rid in self.requests:
                device.update(self.requests[rid].block_table[self._first_key(start) // self.block_size:])
        host = {h for _, h in plan.swap_out} | {h for h, _ in plan.swap_in}
        self._touched[plan.step_id] = (device, host)


@dataclass(frozen=True)
class RequestSpec:
    """Everything needed to build the same request again (Request objects are single-use)."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    cache_salt: str | None = None

    def build(self, arrival_time: float | None = None) -> Request:
        return Request(self.request_id, self.prompt, self.sampling, self.priority, arrival_time, self.cache_salt)


class Driver:
    """The daemon loop in miniature: the engine's `StepLoop`, with the fake as its worker.
    The fake executes each plan as soon as it is planned; its result is committed later, in
    order, exactly when the window would let a daemon commit it."""

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor) -> None:
        self.scheduler = scheduler
        self.loop = StepLoop(scheduler)
        self.executor = executor
        self.results: deque[StepResult] = deque()  # executed, not yet committed, in plan order
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.events: list[RequestEvent] = []
        self.plans: list[StepPlan] = []
        self.num_stale = 0  # sampled tokens the scheduler dropped as stale

    @classmethod
    def create(cls, config: SchedulerConfig, token_fn: TokenFn, clock=None, scheduler_class: type = Scheduler,
               **kwargs) -> Driver:
        sched = scheduler_class(config, clock, **kwargs) if clock else scheduler_class(config, **kwargs)
        fake = FakeExecutor(config.block_size, config.num_gpu_blocks, config.num_cpu_blocks, token_fn,
                            window=config.sliding_window)
        return cls(sched, fake)

    def step(self) -> bool:
        """Schedule and send one plan if possible."""
        plan = self.loop.plan_next()
        if plan is None:
            return False
        self.plans.append(plan)
        self.results.append(self.executor.execute(plan))
        return True

    def deliver(self) -> list[RequestEvent]:
        result = self.results.popleft()
        self.executor.mark_reported(result.step_id)
        _, step_events = self.loop.commit(result)
        events = list(step_events)
        self.num_stale += len(result.sampled_token_ids.keys() - {e.request_id for e in events})
        for event in events:
            self.record(event)
        return events

    def record(self, event: RequestEvent) -> None:
        assert event.request_id not in self.finished, f"event after finish: {event}"
        self.events.append(event)
        self.outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
        if event.finish_reason is not None:
            self.finished[event.request_id] = event.finish_reason

    def abort(self, request_id: str) -> RequestEvent | None:
        event = self.scheduler.abort(request_id)
        if event is not None:
            self.record(event)
        return event

    def tick(self) -> None:
        """One loop turn: fill the in-flight window, then deliver the oldest result."""
        while self.step():
            pass
        if self.results:
            self.deliver()
        elif self.scheduler.has_unfinished_requests():
            raise AssertionError("stuck: requests unfinished, nothing in flight, nothing schedulable")

    def run_until_done(self, max_ticks: int = 10_000, check: bool = True) -> None:
        for _ in range(max_ticks):
            if not self.scheduler.has_unfinished_requests() and not self.results:
                return
            self.tick()
            if check:
                self.scheduler.check_integrity()
        raise AssertionError(f"not done after {max_ticks} ticks")


def run_alone(config: SchedulerConfig, spec: RequestSpec, token_fn: TokenFn) -> tuple[list[int], FinishReason]:
    """The oracle: the same request alone through a fresh synchronous scheduler."""
    from dataclasses import replace

    from scheduler_service.core.kv_manager import cdiv

    solo = replace(
        config,
        num_gpu_blocks=cdiv(config.max_model_len, config.block_size) + 1,
        num_cpu_blocks=0,
        max_num_batched_tokens=max(config.max_model_len, 8),
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        enable_prefix_caching=False,
        async_scheduling=False,
    )
    driver = Driver.create(solo, token_fn)
    driver.scheduler.add_request(spec.build())
    driver.run_until_done()
    return driver.outputs.get(spec.request_id, []), driver.finished[spec.request_id]
