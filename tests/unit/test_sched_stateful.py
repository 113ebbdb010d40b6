"""Hypothesis stateful tests of the scheduler core driven by the fake executor.

Random arrivals (shared prefixes, salts, priorities, min/max tokens, ignore_eos), aborts
at any moment, results delivered at random times, tiny pools that force preemption in
both modes, async on and off, all three policies, n-gram speculation on or off (the fake
proposes and accepts random numbers of drafts), structured requests whose grammars the worker
prepares (reported ready, or refused, at random times). After every rule: `check_integrity()`
(pool accounting, ref counts, scheduled >= computed >= committed, placeholders within
max_tokens). The fake executor checks every plan against the worker contract and the
fences. At the end: everything drains, no block leaks, and every request's committed
output equals (or, if aborted, is a prefix of) its uncontended synchronous run.
"""

from __future__ import annotations

import functools
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.unit.fake_executor import Driver, RequestSpec, hashed_tokens, run_alone
from scheduler_service.core.config import PreemptionMode, SchedulerConfig, SchedulingPolicy
from scheduler_service.core.kv_manager import cdiv
from scheduler_service.core.policy import ScorePolicy
from scheduler_service.core.request import FinishReason, RequestStatus
from stepahead.plan import GrammarReady, SamplingParams, StructuredKind, StructuredOutput

EOS = 0
TOKEN_FN = hashed_tokens(vocab_size=12)  # EOS (0) comes up about once in 12 tokens
MAX_PROMPT, MAX_TOKENS = 10, 8
PREFIXES = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5, 5, 5, 5)]
CHOICE = StructuredOutput(StructuredKind.CHOICE, choices=("a", "b"))  # the fake worker samples as if free


@st.composite
def configs(draw) -> SchedulerConfig:
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.sampled_from([12, 20]))
    chunked = draw(st.booleans())
    need = cdiv(min(MAX_PROMPT + MAX_TOKENS, max_model_len) - 1, block_size)
    host_tier = draw(st.sampled_from([False, False, True]))  # the prefix cache's host tier, in the host pool
    return SchedulerConfig(
        block_size=block_size,
        num_gpu_blocks=need + draw(st.sampled_from([0, 0, 1, 2, 6])),
        num_cpu_blocks=16 if host_tier else draw(st.sampled_from([0, 4, 16, 16])),
        max_model_len=max_model_len,
        max_num_seqs=draw(st.sampled_from([2, 3, 8])),
        max_num_batched_tokens=draw(st.sampled_from([3, 8, 32])) if chunked else 32,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])) if chunked else 0,
        enable_prefix_caching=host_tier or draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(list(SchedulingPolicy))),
        preemption_mode=draw(st.sampled_from(list(PreemptionMode))),
        async_scheduling=draw(st.booleans()),
        max_concurrent_batches=draw(st.sampled_from([2, 2, 3])),  # 3: two placeholders deep
        eos_token_ids=(EOS,),
        max_wait_time=3.0,
        score_length_weight=draw(st.sampled_from([0.005, 0.5])),  # 0.5: length outweighs arrival order
        score_ttft_target=draw(st.sampled_from([0.0, 2.0])),
        num_speculative_tokens=draw(st.sampled_from([0, 0, 1, 3])),
        sliding_window=draw(st.sampled_from([0, 0, 3, 5])),  # every layer windowed: slid blocks are freed
        num_offload_blocks=8 if host_tier else 0,
        prepare_grammars=draw(st.booleans()),
    )


@st.composite
def request_params(draw) -> tuple:
    prefix = draw(st.sampled_from(PREFIXES))
    suffix = draw(st.lists(st.integers(1, 11), max_size=5))
    prompt = (tuple(prefix) + tuple(suffix))[:MAX_PROMPT] or (7,)
    max_tokens = draw(st.integers(1, MAX_TOKENS))
    structured = draw(st.sampled_from([None, None, CHOICE]))  # a grammar ends with EOS: no min_tokens, no ignore_eos
    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=0 if structured else draw(st.integers(0, min(3, max_tokens))),
        ignore_eos=False if structured else draw(st.booleans()),
        stop_token_ids=draw(st.sampled_from([(), (3,)])),
        structured=structured,
    )
    return prompt, sampling, draw(st.integers(0, 2)), draw(st.sampled_from([None, None, "tenant-a"]))


@functools.lru_cache(maxsize=100_000)
def oracle(max_model_len: int, spec: RequestSpec) -> tuple[tuple[int, ...], FinishReason]:
    config = SchedulerConfig(num_gpu_blocks=64, max_model_len=max_model_len, block_size=4, eos_token_ids=(EOS,))
    tokens, reason = run_alone(config, spec, TOKEN_FN)
    return tuple(tokens), reason


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(config=configs(), spec_seed=st.integers(0, 2**16))
    def setup(self, config: SchedulerConfig, spec_seed: int) -> None:
        self.now = 0.0
        self.config = config
        self.driver = Driver.create(config, TOKEN_FN, clock=lambda: self.now)
        self.driver.executor.spec_rng = random.Random(spec_seed)  # random drafts and acceptance counts
        self.sched = self.driver.scheduler
        self.specs: dict[str, RequestSpec] = {}
        self.policy = ScorePolicy(config)

    @rule(batch=st.lists(request_params(), min_size=1, max_size=3))
    def add(self, batch) -> None:
        for prompt, sampling, priority, salt in batch:
            spec = RequestSpec(f"r{len(self.specs)}", prompt, sampling, priority, salt)
            self.specs[spec.request_id] = spec
            self.sched.add_request(spec.build())

    @rule()
    def step(self) -> None:
        waiting_before = {r.request_id: self.policy.queue_key(r, self.now) for r in self.sched.waiting_requests()}
        if waiting_before and self.config.scheduling_policy is SchedulingPolicy.SCORE:
            head = self.sched._waiting.peek(self.now)  # aged, urgent (TTFT target) or best score
            assert waiting_before[head.request_id] == min(waiting_before.values()), head
        if not self.driver.step():
            return
        plan = self.driver.plans[-1]
        if self.config.scheduling_policy is SchedulingPolicy.SCORE:
            self._check_aging(plan, waiting_before)

    def _check_aging(self, plan, waiting_before) -> None:
        """An aged request is never passed over: whatever was admitted came before it."""
        admitted = [waiting_before[r.request_id] for r in plan.new_requests if r.request_id in waiting_before]
        for left in self.sched.waiting_requests():
            if left.request_id in waiting_before and self.policy.is_aged(left, self.now):
                key_left = waiting_before[left.request_id]
                assert all(key <= key_left for key in admitted), f"{admitted} admitted before aged {left}"

    @rule()
    def deliver(self) -> None:
        if self.driver.results:
            self.driver.deliver()

    @rule(data=st.data())
    def abort(self, data) -> None:
        ids = sorted(self.specs) + ["unknown"]
        rid = data.draw(st.sampled_from(ids))
        live = self.sched.get_request(rid) is not None
        event = self.driver.abort(rid)
        assert (event is not None) == live
        if event is not None:
            assert event.finish_reason is FinishReason.ABORT and event.new_token_ids == ()

    @rule(data=st.data(), refuse=st.sampled_from([False, False, False, True]))
    def report_grammar(self, data, refuse: bool) -> None:
        """The worker reports a grammar a plan ordered (in any order; a refusal ends the request)."""
        ordered = sorted({g.request_id for p in self.driver.plans for g in p.grammars}
                         & {rid for rid, r in self.sched._requests.items() if r.status is RequestStatus.PREPARING})
        if not ordered:
            return
        rid = data.draw(st.sampled_from(ordered))
        event = self.sched.grammar_ready(GrammarReady(rid, "refused" if refuse else "", invalid=refuse))
        assert (event is not None) == refuse
        if event is not None:
            assert event.finish_reason is FinishReason.ERROR and event.rejected
            self.driver.record(event)
        assert self.sched.grammar_ready(GrammarReady(rid)) is None  # a second report (another rank's) is dropped

    @rule(dt=st.sampled_from([0.5, 1.0, 4.0]))
    def tick_clock(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    @invariant()
    def outputs_are_prefixes_of_the_oracle(self) -> None:
        if not hasattr(self, "sched"):
            return
        for rid, got in self.driver.outputs.items():
            want, _ = oracle(self.config.max_model_len, self.specs[rid])
            assert tuple(got) == want[: len(got)], f"{rid}: {got} is not a prefix of {want}"

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        while self.sched.num_preparing:  # the worker reports every grammar it was ordered
            for rid in {g.request_id for plan in self.driver.plans for g in plan.grammars}:
                self.sched.grammar_ready(GrammarReady(rid))  # dropped unless PREPARING
            if self.sched.num_preparing and not self.driver.step():  # the window is full: a result makes room
                self.driver.deliver()
        self.driver.run_until_done(max_ticks=2_000)
        stats = self.sched.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, f"leaked device blocks: {stats}"
        assert stats.num_fenced_blocks == 0 and stats.num_used_host_blocks == 0, stats
        event(f"preempted: {stats.num_preemptions > 0}, swapped: {stats.num_swap_outs > 0}")
        event(f"prefix hit: {stats.prefix_hit_tokens > 0}, aborted: {stats.num_aborted > 0}")
        event(f"stale results: {self.driver.num_stale > 0}")
        prepared = {g.request_id for plan in self.driver.plans for g in plan.grammars}
        event(f"grammars prepared: {bool(prepared)}, refused: "
              f"{any(self.driver.finished.get(rid) is FinishReason.ERROR for rid in prepared)}")
        counts = self.sched.counters()
        event(f"drafts accepted: {counts['spec_num_accepted_tokens'] > 0}, "
              f"rejected: {counts['spec_num_draft_tokens'] > counts['spec_num_accepted_tokens']}")
        event(f"host tier: offloaded {stats.num_offloaded_blocks > 0}, hit {stats.prefix_host_hit_tokens > 0}, "
              f"evicted {stats.num_host_evictions > 0}")
        event(f"blocks slid: {stats.num_slid_blocks > 0}, slid and swapped: "
              f"{stats.num_slid_blocks > 0 and stats.num_swap_outs > 0}")
        for rid, spec in self.specs.items():
            reason = self.driver.finished[rid]
            if reason in (FinishReason.ABORT, FinishReason.ERROR):  # aborted, or its grammar refused
                continue
            want, want_reason = oracle(self.config.max_model_len, spec)
            assert (tuple(self.driver.outputs[rid]), reason) == (want, want_reason), rid


# The active profile's example count (500 default, 5000 with --slow); collection runs after
# conftest loaded the profile, so settings() inherits it.
SchedulerMachine.TestCase.settings = settings(stateful_step_count=40)
TestSchedulerStateful = SchedulerMachine.TestCase
