"""The scheduler core: composes the queue policy, the KV manager, the running set, the step
builder and the committer.

Per step: running requests first (policy order; on block shortage the worst running one is
preempted; runs of plain decodes in bulk, `decodes.py`), then swapped, then waiting; one
token budget and one sequence budget. Async: up to `max_concurrent_batches` plans in flight,
in-flight samples counted as placeholders, results committed in plan order (`commit.py`);
results for requests preempted / finished / aborted since are stale. Per-request token rules
(tokens per step, when a token ends a request): `token_rules.py`.

Disaggregation (`config.role`, docs/disaggregation.md): a PREFILL core schedules a request
only until it samples a token (`Request.handoff_at`); when that token commits and does not
end the request, the request is *handed off* (`take_handoffs`): it leaves this core, whose
blocks keep its KV until the engine says the decode side is done with them
(`release_handoff`). A decode core takes it with `add_transferred`: it queues like a
readmitted request; admitted, it gets blocks (its local prefix-cache hit needs no copy) and
its plan orders a `KVLoad` of the rest from the source worker; it then holds its blocks
without running (LOADING) until the worker reports the load (`kv_loaded`), and resumes with
its prompt computed; a failed load computes it again here. `take_released_sources` lists the
transfers whose source blocks this core no longer needs (loaded, failed, or never started).

Grammars (`config.prepare_grammars`, the worker's hello): a structured request does not queue
at once. It waits PREPARING while its worker compiles its grammar beside the steps (the next
plan's `grammars` orders it) and queues when the worker reports it (`grammar_ready`), so no
step waits for a compile; a grammar the worker refuses fails the request as invalid.

Progress: a waiting request preempts running work only for what preemption frees for good
(a sequence slot, KV blocks), never for this step's token budget (that hands one step's
tokens from a running request to a new one and throws the victim's work away). And the core
watches its progress: once more committed steps in a row than any run without lost work
needs (`stall_limit`) gave no request a token nor ended one, `stall()` says why (the
simulator stops with it).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from operator import attrgetter

import numpy as np

from scheduler_service.core.admission import ExpectedWait, check_submission
from scheduler_service.core.block_pool import BlockHashFn, default_block_hash
from scheduler_service.core.config import PreemptionMode, SchedulerConfig
from scheduler_service.core.commit import StepCommitter
from scheduler_service.core.decodes import decode_masks
from scheduler_service.core.events import RequestEvent, StepEvents
from scheduler_service.core.integrity import check_core
from scheduler_service.core.kv_manager import KVCacheManager, PrefixHit, cdiv
from scheduler_service.core.policy import WaitingQueue, make_policy
from scheduler_service.core.preemption import PreemptionRule
from scheduler_service.core.running_set import RunningSet
from scheduler_service.core.speculation import draft_allowance
from scheduler_service.core.result_checks import check_result
from scheduler_service.core.request import (
    FINISHED_STATUS, NEVER, FinishReason, KVSource, QueueFull, Request, RequestRejected, RequestStatus,
)
from scheduler_service.core.stats import SchedulerStats, build_stats, count_result
from scheduler_service.core.step_builder import InFlightPlan, StepBuilder
from scheduler_service.core.token_rules import num_new_tokens
from stepahead.plan import GrammarPrep, GrammarReady, KVLoad, KVLoaded, StepPlan, StepResult, WorkerRole

__all__ = ["FinishReason", "Handoff", "QueueFull", "RequestEvent", "RequestRejected", "Scheduler", "SchedulerStats",
           "StepEvents"]


_run_key = attrgetter("run_key")  # the policy's order of running / swapped requests


@dataclass(frozen=True)
class Handoff:
    """A request a prefill core finished with: it moves to a decode core with its KV."""

    request: Request  # its first output token committed; no longer this core's
    block_ids: tuple[int, ...]  # this core's blocks holding its KV, held until `release_handoff`


class _Admission(Enum):
    OK = auto()
    NO_SEQ = auto()  # max_num_seqs reached
    NO_BUDGET = auto()  # token budget spent
    WAIT_FENCE = auto()  # fits once in-flight plans release their fences: wait, do not preempt
    NO_BLOCKS = auto()


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic,
        hash_fn: BlockHashFn = default_block_hash, *, counters: Counter | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._policy = make_policy(config)
        self._preemption = PreemptionRule(config)
        self._expected_wait = ExpectedWait(config.max_expected_wait, config.max_wait_time)
        self._kv = KVCacheManager(
            config.block_size, config.num_gpu_blocks, config.num_cpu_blocks, config.enable_prefix_caching, hash_fn,
            config.sliding_window, config.num_offload_blocks > 0,
        )
        self._requests: dict[str, Request] = {}
        self._waiting = WaitingQueue(self._policy)
        self._running = RunningSet(config.max_num_seqs, config.block_size, config.max_model_len)
        # plain decodes in bulk (`decodes.py`); a speculating decode is decided alone (the tests'
        # lockstep oracle, tests/unit/per_request_scheduler.py, turns the bulk path off)
        self._bulk = not config.num_speculative_tokens
        self._committer = StepCommitter(config, self._kv, self._finish, self._requests, self._hand_off)
        self._swapped: list[Request] = []
        self._in_flight: deque[InFlightPlan] = deque()
        self._next_step_id = 0
        self._pending_finished: list[str] = []
        self._pending_preempted: list[str] = []
        self._shed: list[tuple[str, QueueFull]] = []  # refused after they were queued (`take_shed`)
        self._counts = Counter(counters or {})  # carried over from an earlier core: totals survive re-attach
        self._stall_limit = stall_limit(config)
        self._steps_without_token = 0  # committed steps in a row that gave no request a token or an end
        self._preemptions_at_progress = self._counts["num_preemptions"]
        # disaggregation (the module doc)
        self._hands_off = config.role is WorkerRole.PREFILL
        self._handoffs: list[Handoff] = []  # handed off since `take_handoffs`
        self._held: dict[str, tuple[list[int], int]] = {}  # handed-off id -> (its blocks, newest plan)
        self._loading: dict[str, Request] = {}  # LOADING requests by id (loads in flight, and done)
        self._loads: dict[int, Request] = {}  # transfer id -> request whose load is in flight
        self._load_sizes: dict[int, int] = {}  # transfer id -> blocks it loads
        self._loaded: list[Request] = []  # LOADING requests whose KV is in, to resume (oldest first)
        self._released_sources: list[int] = []  # transfers whose source blocks this core is done with
        # grammars (the module doc): PREPARING requests and the status they queue with
        self._preparing: dict[str, tuple[Request, RequestStatus]] = {}
        self._to_prepare: list[Request] = []  # PREPARING, not ordered in a plan yet

    def counters(self) -> Counter:
        """A copy of the monotonic counters (steps, finishes, preemptions, prefix tokens)."""
        return Counter(self._counts)

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._requests:
            raise RequestRejected(f"duplicate request id {rid!r}: a request with this id is still active")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens or request.epoch:
            raise RequestRejected(f"request {rid!r} was already used by a scheduler")
        check_submission(self.config, request, len(self._waiting) + len(self._preparing))
        now = self._clock()
        self._expected_wait.check(request, self._policy.ahead_of(request.priority, self._waiting.by_priority), now)
        if request.arrival_time is None:
            request.arrival_time = now
        request.queued_time = now
        request.handoff_at = request.num_tokens + 1 if self._hands_off else NEVER
        self._requests[rid] = request
        self._queue(request)

    def _queue(self, request: Request) -> None:
        """A new or adopted request into the waiting queue, or first PREPARING (the module doc)."""
        if self.config.prepare_grammars and request.sampling.structured is not None:
            self._preparing[request.request_id] = (request, request.status)
            request.status = RequestStatus.PREPARING
            self._to_prepare.append(request)
        else:
            self._waiting.push(request)

    def grammar_ready(self, ready: GrammarReady) -> RequestEvent | None:
        """The worker reports a grammar it was ordered: its request queues, or fails (the
        event to send). A report for a request that is not PREPARING is dropped: it ended
        meanwhile (aborted), or it came from a replica's other rank."""
        entry = self._preparing.get(ready.request_id)
        if entry is None:
            return None
        req, status = entry
        if ready.error:
            self._finish(req, FinishReason.ERROR)
            return RequestEvent(req.request_id, (), FinishReason.ERROR, req.num_prompt_tokens, req.num_cached_tokens,
                                f"worker: {ready.error}", rejected=ready.invalid)
        del self._preparing[req.request_id]
        if req in self._to_prepare:  # reported before it was ordered: only a confused worker does that
            self._to_prepare.remove(req)
        req.status = status
        self._waiting.push(req)
        return None

    def abort(self, request_id: str) -> RequestEvent | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return RequestEvent(request.request_id, (), FinishReason.ABORT, request.num_prompt_tokens,
                            request.num_cached_tokens)

    def adopt(self, request: Request) -> None:
        """Take over an unfinished request of a lost replica, as recompute: its committed
        output stays (the client has seen it), its KV lived on the lost worker and is computed
        again here over prompt + committed output. It queues with its original arrival time."""
        rid = request.request_id
        if rid in self._requests:
            raise RequestRejected(f"duplicate request id {rid!r}: a request with this id is still active")
        assert not request.is_running_row, "adopt a request its earlier core released"
        assert request.arrival_time is not None, "adopt a request that arrived (its policy keys read the time)"
        request.block_ids, request.host_block_ids, request.prefix_ids = [], [], []
        request.num_slid_blocks = 0
        request.num_scheduled_tokens = request.num_computed_tokens = request.num_output_placeholders = 0
        request.epoch += 1
        request.in_worker, request.last_step_id, request.queue_token, request.run_key = False, -1, None, ()
        request.status = RequestStatus.PREEMPTED
        request.queued_time = self._clock()
        request.handoff_at = request.num_tokens + 1 if self._hands_off else NEVER
        request.kv_source = None
        self._requests[rid] = request
        self._queue(request)

    def add_transferred(self, request: Request, source: str, block_ids: tuple[int, ...], transfer_id: int,
                        source_instance: str = "") -> None:
        """Take over a request a prefill core handed off (`Handoff`): queued like a readmitted
        request; admitted, its prompt's KV is loaded from `source` (the prefill worker's
        transfer address and instance), where `block_ids` hold it, instead of computed."""
        assert not self._hands_off, "a prefill core takes no transferred request"
        self.adopt(request)
        request.kv_source = KVSource(source, tuple(block_ids), transfer_id, source_instance)

    def source_lost(self, transfer_id: int) -> None:
        """The source of a transfer is gone: a request still waiting for it is computed here
        instead (one whose load is in flight learns it from the failed load)."""
        for req in [*self._waiting.requests(), *(r for r, _ in self._preparing.values())]:
            if req.kv_source is not None and req.kv_source.transfer_id == transfer_id:
                req.kv_source = None
                self._released_sources.append(transfer_id)
                return

    def kv_loaded(self, loaded: KVLoaded) -> None:
        """The worker reports a load it was ordered: the request resumes with its KV (next
        plan), or on an error is computed again here. ValueError for a transfer this core
        never ordered or already heard of."""
        req = self._loads.pop(loaded.transfer_id, None)
        if req is None:
            raise ValueError(f"kv_loaded: transfer {loaded.transfer_id} is not a load in flight on this replica")
        size = self._load_sizes.pop(loaded.transfer_id)
        self._released_sources.append(loaded.transfer_id)
        if req.status is not RequestStatus.LOADING:  # finished (aborted) while loading: its blocks are free now
            self._kv.free(req)
            return
        if loaded.error:
            self._counts["num_failed_loads"] += 1
            del self._loading[req.request_id]
            self._kv.free(req)
            req.num_computed_tokens = req.num_scheduled_tokens = 0
            req.status = RequestStatus.PREEMPTED
            req.queued_time = self._clock()
            self._waiting.push(req)
            return
        self._counts["num_loaded_blocks"] += size
        self._kv.register_computed(req)  # the loaded prompt's full blocks serve later hits here
        self._loaded.append(req)

    def take_handoffs(self) -> list[Handoff]:
        """The requests handed off since the last call (prefill core), oldest first."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def release_handoff(self, request_id: str) -> None:
        """A handed-off request's decode side no longer needs its blocks here: free them."""
        held = self._held.pop(request_id, None)
        if held is not None:
            blocks, last_step = held
            self._kv.device.free(reversed(blocks), last_step)

    def take_released_sources(self) -> list[int]:
        """Transfers whose source blocks this core no longer needs, since the last call."""
        released, self._released_sources = self._released_sources, []
        return released

    def release(self) -> list[Request]:
        """Every request this core still holds, oldest arrival first, to move elsewhere
        (`adopt`): the core is being dropped and must not be used afterwards."""
        for req in list(self._running):
            self._running.remove(req)  # its counters back on the request
        for req in self._requests.values():  # each moves as recompute: its sources are done with
            if req.kv_source is not None:
                self._released_sources.append(req.kv_source.transfer_id)
            req.kv_source = None
        self._released_sources.extend(self._loads)
        self._to_prepare = []
        return sorted(self._requests.values(), key=lambda r: (r.arrival_time or 0.0, r.request_id))

    # ---- the step ----------------------------------------------------------------------------
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def can_schedule(self) -> bool:
        return len(self._in_flight) < self.config.max_in_flight

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def num_preparing(self) -> int:
        """Requests waiting for their worker's grammar report (PREPARING)."""
        return len(self._preparing)

    def take_shed(self) -> list[tuple[str, QueueFull]]:
        """Requests refused since the last call after they had been queued (admission control:
        not admitted within the aging bound), each with its refusal; they are gone from the core."""
        shed, self._shed = self._shed, []
        return shed

    def schedule(self) -> StepPlan | None:
        if not self.can_schedule():
            return None
        now = self._clock()
        self._shed_overdue(now)
        cfg = self.config
        b = StepBuilder(self._next_step_id, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        deferred = self._schedule_running(b, now)
        if self._loaded:
            self._schedule_loaded(b, now)
        if not b.preempted and not deferred and not self._schedule_swapped(b, now):
            self._schedule_waiting(b, now)
        if self._to_prepare:
            b.grammars.extend(GrammarPrep(r.request_id, r.sampling.structured) for r in self._to_prepare)
            self._to_prepare = []
        if self._kv.host_tier:  # before anything computes, the plan copies what allocation evicted
            offloads = self._kv.take_offloads(b.step_id)
            b.swap_out.extend(offloads)
            self._counts["num_offloaded_blocks"] += len(offloads)
            self._counts["num_host_evictions"] += self._kv.host.take_num_evictions()
        if b.is_empty:
            return None
        plan, in_flight = b.build(self._pending_finished, self._pending_preempted, self._running.columns)
        self._pending_finished, self._pending_preempted = [], []
        self._in_flight.append(in_flight)
        self._next_step_id += 1
        return plan

    def _schedule_running(self, b: StepBuilder, now: float) -> bool:
        """Advance running requests in policy order; returns True if one was deferred
        waiting for a fence. Runs of plain decodes are taken in bulk (`decodes.py`), every
        other request is decided alone."""
        running = self._running
        if self._bulk:
            decode, new_block = decode_masks(running, b.step_id - 1)
            alone = np.flatnonzero(~decode).tolist()
        deferred, i = False, 0
        while i < len(running) and b.token_budget > 0 and b.seq_budget > 0:
            if self._bulk:
                j = bisect.bisect_left(alone, i)
                end = min(alone[j] if j < len(alone) else len(running), len(running))
                taken = self._take_decodes(b, i, end, new_block) if end > i else 0
                if taken:
                    i += taken
                    continue
            req = running[i]
            deferred |= self._schedule_one(req, b)
            if req.status is RequestStatus.RUNNING:
                i += 1  # otherwise it preempted itself, and it was the last one
        return deferred

    def _take_decodes(self, b: StepBuilder, start: int, end: int, new_block: np.ndarray) -> int:
        """The plain decodes of running positions [start, end) in bulk, as far as the budgets
        and the free blocks go (one for each whose blocks are full); returns how many. A
        decode left without a block is decided alone (it may preempt, or wait for a fence)."""
        take = min(end - start, b.token_budget, b.seq_budget)
        wants, free = np.flatnonzero(new_block[start:start + take]), self._kv.device.num_free
        if len(wants) > free:
            take, wants = int(wants[free]), wants[:free]
        growing = [self._running[start + p] for p in wants.tolist()]
        if self.config.sliding_window:  # a table grows by a block as often as the window slides past one
            for req in growing:
                self._release_slid(req)
        grown = [(p, req, len(req.block_ids)) for p, req in zip(wants.tolist(), growing)]  # before the append
        self._kv.append_blocks(growing)
        b.add_decodes(self._running.rows()[start:start + take], grown)
        return take

    def _schedule_one(self, req: Request, b: StepBuilder) -> bool:
        """A running request's part of the step, decided alone; True if it waits for a fence."""
        cfg = self.config
        remaining = req.num_tokens + req.num_output_placeholders - req.num_scheduled_tokens
        n = num_new_tokens(cfg, req, remaining, b.token_budget, b.step_id - 1)
        drafts = draft_allowance(cfg, req, b.token_budget) if cfg.num_speculative_tokens and n == remaining == 1 else 0
        if not n:
            return False
        n += drafts
        first_new_block = len(req.block_ids)
        if req.num_scheduled_tokens + n > first_new_block * cfg.block_size:  # it needs a new block
            self._release_slid(req)
            outcome = self._reserve(req, req.num_scheduled_tokens + n, b)
            if outcome is not _Admission.OK:
                return outcome is _Admission.WAIT_FENCE
        if n == remaining == 1:
            b.add_decode(req, first_new_block)
        else:
            b.add(req, n, False, first_new_block, drafts)
        return False

    def _reserve(self, req: Request, num_tokens: int, b: StepBuilder) -> _Admission:
        """Blocks for `num_tokens`, preempting the worst running requests while short."""
        while not self._kv.allocate_slots(req, num_tokens):
            need = self._kv.blocks_needed(req, num_tokens)
            if self._kv.could_allocate_later(need):
                return _Admission.WAIT_FENCE
            victim = self._running[-1]  # the worst (not `preemption.py`'s protection: the step's decode masks index by position)
            self._preempt(victim, b)
            if victim is req:
                return _Admission.NO_BLOCKS
        return _Admission.OK

    def _release_slid(self, req: Request) -> None:
        self._counts["num_slid_blocks"] += self._kv.release_slid(req)

    def _add_running(self, req: Request, now: float) -> None:
        req.status = RequestStatus.RUNNING
        req.run_key = self._policy.running_key(req, now)
        self._running.insert(req)

    def _schedule_swapped(self, b: StepBuilder, now: float) -> bool:
        """Swap requests back in, before new admissions; returns True if one that should
        go next did not fit (then nothing new is admitted this step)."""
        self._swapped.sort(key=_run_key)
        while self._swapped:
            req = self._swapped[0]
            if self._outranked_by_waiting(req, now):
                return False
            n = num_new_tokens(self.config, req, req.num_tokens - req.num_computed_tokens, b.token_budget)
            need = max(len(req.host_block_ids),
                       cdiv(req.num_computed_tokens + n, self.config.block_size) - req.num_slid_blocks)
            full = b.seq_budget == 0 or len(self._running) >= self.config.max_num_seqs
            if full or n == 0 or need > self._kv.device.num_free:
                return True
            self._swap_in(req, n, b, now)
        return False

    def _schedule_loaded(self, b: StepBuilder, now: float) -> None:
        """Resume the requests whose KV was loaded, oldest first: each decodes its first output
        token, sent in full with its prompt computed."""
        while self._loaded and b.token_budget > 0 and b.seq_budget > 0:
            req = self._loaded.pop(0)  # its first decode's slot came with its admission
            del self._loading[req.request_id]
            self._add_running(req, now)
            b.add(req, 1, True, 0)

    def _outranked_by_waiting(self, req: Request, now: float) -> bool:
        """Would the head of the waiting queue preempt this request anyway? Then it goes
        first (swapping in a request only to preempt it again would livelock)."""
        head = self._waiting.peek(now)
        policy = self._policy
        return (
            head is not None
            and policy.may_preempt(head, req, now)
            and policy.queue_key(head, now) < policy.queue_key(req, now)
        )

    def _schedule_waiting(self, b: StepBuilder, now: float) -> None:
        """Admit the queue's head while it fits; one that does not may preempt running work
        (`_policy_victim`) and takes what the preemption freed (the victim, queued again, may
        rank ahead of it: a preempted stream is readmitted first)."""
        while len(self._waiting):
            req = self._waiting.peek(now)
            while (outcome := self._try_admit(req, b, now)) is not _Admission.OK:
                if outcome is _Admission.WAIT_FENCE or outcome is _Admission.NO_BUDGET:
                    return  # preempting would free nothing that lasts past this step
                victim = self._policy_victim(req, b, now)
                if victim is None:
                    return
                self._preempt(victim, b)

    def _try_admit(self, req: Request, b: StepBuilder, now: float) -> _Admission:
        if len(self._running) + len(self._loading) >= self.config.max_num_seqs or b.seq_budget == 0:
            return _Admission.NO_SEQ
        if req.kv_source is not None:
            return self._try_load(req, b, now)
        hit = self._kv.find_prefix_hit(req)
        computed = hit.num_blocks * self.config.block_size
        n = num_new_tokens(self.config, req, req.num_tokens - computed, b.token_budget)
        if n == 0:
            return _Admission.NO_BUDGET
        need = cdiv(computed + n, self.config.block_size) - hit.num_device_blocks + hit.num_free_hits
        if need > self._kv.device.num_free:
            return _Admission.WAIT_FENCE if self._kv.could_allocate_later(need) else _Admission.NO_BLOCKS
        self._admit(req, hit, n, b, now)
        return _Admission.OK

    def _try_load(self, req: Request, b: StepBuilder, now: float) -> _Admission:
        """Admit a transferred request: blocks for its prompt, the ones its local prefix-cache
        hit (device, then host tier) lacks loaded from the source (a `KVLoad` in this plan).
        It preempts nobody: it waits for free blocks (its source holds the KV meanwhile)."""
        bs, source = self.config.block_size, req.kv_source
        if b.token_budget == 0:
            return _Admission.NO_BUDGET
        hit = self._kv.find_prefix_hit(req)  # cached here, on the device or in the host tier
        num_prompt_blocks = cdiv(req.num_prompt_tokens, bs)
        if num_prompt_blocks > len(source.block_ids) or req.num_tokens != req.num_prompt_tokens + 1:
            req.kv_source = None  # not a prefill's hand-off: computed here
            self._released_sources.append(source.transfer_id)
            return self._try_admit(req, b, now)
        # blocks for the prompt and its first decode: a loaded request can always resume (one
        # holding a prompt's blocks that cannot take a step could wait for ever)
        need = cdiv(req.num_prompt_tokens + 1, bs) - hit.num_device_blocks + hit.num_free_hits
        if need > self._kv.device.num_free:
            return _Admission.WAIT_FENCE
        self._waiting.remove(req)
        self._expected_wait.admitted(now, len(self._waiting))
        self._kv.take_hit(req, hit)
        ok = self._kv.allocate_slots(req, req.num_prompt_tokens + 1)
        assert ok, "admission checked the free blocks"
        b.swap_in.extend(self._kv.load_host_hit(req, hit, b.step_id))  # before anything computes
        req.num_computed_tokens = req.num_scheduled_tokens = req.num_prompt_tokens
        req.kv_source = None
        self._counts["prefix_query_tokens"] += req.num_prompt_tokens
        self._counts["prefix_hit_tokens"] += hit.num_blocks * bs
        self._counts["prefix_host_hit_tokens"] += len(hit.host_block_ids) * bs
        first = hit.num_blocks
        if first == num_prompt_blocks:  # all of it cached here: nothing to load, it runs now
            self._released_sources.append(source.transfer_id)
            self._add_running(req, now)
            b.add(req, 1, True, 0)
            return _Admission.OK
        req.status = RequestStatus.LOADING
        self._loading[req.request_id] = req
        req.last_step_id = b.step_id  # the blocks are this plan's until the load is reported
        b.kv_loads.append(KVLoad(source.transfer_id, source.address, source.block_ids[first:num_prompt_blocks],
                                 tuple(req.block_ids[first:num_prompt_blocks]), source.instance))
        self._loads[source.transfer_id] = req
        self._load_sizes[source.transfer_id] = num_prompt_blocks - first
        return _Admission.OK

    def _policy_victim(self, candidate: Request, b: StepBuilder, now: float) -> Request | None:
        """The running request the policy lets the waiting `candidate` preempt, if any: of
        those whose preemption pays and that are not protected (`preemption.py`)."""
        if not self._policy.can_preempt_running:
            return None
        rule = self._preemption
        worst_first = (r for r in reversed(self._running) if not b.is_scheduled_new(r))
        return self._policy.pick_victim(candidate, rule.policy_victims(worst_first, rule.gain(self._running)), now)

    def _shed_overdue(self, now: float) -> None:
        """Refuse the waiting requests that reached the aging bound with no token, oldest first
        (`ExpectedWait.overdue`; only when admission control is on)."""
        while (oldest := self._waiting.oldest()) is not None:
            refusal = self._expected_wait.overdue(oldest, now)
            if refusal is None:
                return
            self._waiting.remove(oldest)
            del self._requests[oldest.request_id]
            oldest.status = RequestStatus.FINISHED_ABORTED
            oldest.epoch += 1
            self._shed.append((oldest.request_id, refusal))
            self._counts["num_shed"] += 1
            self._progressed()

    # ---- status transitions --------------------------------------------------------------
    def _admit(self, req: Request, hit: PrefixHit, n: int, b: StepBuilder, now: float) -> None:
        self._waiting.remove(req)
        self._expected_wait.admitted(now, len(self._waiting))
        self._kv.take_hit(req, hit)
        req.num_computed_tokens = req.num_scheduled_tokens = hit.num_blocks * self.config.block_size
        ok = self._kv.allocate_slots(req, req.num_computed_tokens + n)
        assert ok, "admission checked the free blocks"
        b.swap_in.extend(self._kv.load_host_hit(req, hit, b.step_id))
        self._add_running(req, now)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self._clock()
            req.num_cached_tokens = req.num_computed_tokens
        self._counts["prefix_query_tokens"] += req.num_tokens
        self._counts["prefix_hit_tokens"] += req.num_computed_tokens
        self._counts["prefix_host_hit_tokens"] += len(hit.host_block_ids) * self.config.block_size
        b.add(req, n, True, 0)

    def _swap_in(self, req: Request, n: int, b: StepBuilder, now: float) -> None:
        pairs = self._kv.swap_in(req, b.step_id)
        assert pairs is not None and self._kv.allocate_slots(req, req.num_computed_tokens + n)
        b.swap_in.extend(pairs)
        self._swapped.remove(req)
        self._add_running(req, now)
        b.add(req, n, True, 0)

    def _preempt(self, victim: Request, b: StepBuilder) -> None:
        """Take a running request off the device: swap its KV out, or drop it (recompute)."""
        b.unschedule(victim)
        self._running.remove(victim)
        b.preempted = True
        victim.epoch += 1  # its in-flight results are stale from now on
        victim.num_output_placeholders = 0
        victim.num_preemptions += 1
        victim.output_at_preemption = victim.num_output_tokens
        self._counts["num_preemptions"] += 1
        if victim.in_worker:
            self._pending_preempted.append(victim.request_id)
            victim.in_worker = False
        pairs = None
        if self.config.preemption_mode is PreemptionMode.SWAP:
            pairs = self._kv.swap_out(victim, b.step_id)
        if pairs:
            b.swap_out.extend(pairs)
            victim.num_scheduled_tokens = victim.num_computed_tokens
            victim.status = RequestStatus.SWAPPED
            victim.queued_time = self._clock()
            self._swapped.append(victim)
            self._counts["num_swap_outs"] += 1
            return
        self._kv.free(victim)
        victim.num_computed_tokens = victim.num_scheduled_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.queued_time = self._clock()
        self._waiting.push(victim)

    def _hand_off(self, req: Request) -> None:
        """A prefill core's request sampled its token: it leaves, its blocks stay (`Handoff`)."""
        self._running.remove(req)
        blocks = list(req.owned_block_ids)
        self._held[req.request_id] = (blocks, req.last_step_id)
        req.epoch += 1
        if req.in_worker:  # the worker forgets it; its blocks keep the KV
            self._pending_finished.append(req.request_id)
            req.in_worker = False
        del self._requests[req.request_id]
        self._handoffs.append(Handoff(req, tuple(blocks)))
        self._progressed()
        self._counts["num_handoffs"] += 1

    def _finish(self, req: Request, reason: FinishReason) -> None:
        match req.status:
            case RequestStatus.RUNNING:
                self._running.remove(req)
            case RequestStatus.SWAPPED:
                self._swapped.remove(req)
            case RequestStatus.WAITING | RequestStatus.PREEMPTED:
                self._waiting.remove(req)
                if req.kv_source is not None:  # never loaded: its source blocks can go
                    self._released_sources.append(req.kv_source.transfer_id)
                    req.kv_source = None
            case RequestStatus.LOADING:
                del self._loading[req.request_id]
                if req in self._loaded:
                    self._loaded.remove(req)
            case RequestStatus.PREPARING:
                del self._preparing[req.request_id]
                if req in self._to_prepare:
                    self._to_prepare.remove(req)
                if req.kv_source is not None:  # never loaded: its source blocks can go
                    self._released_sources.append(req.kv_source.transfer_id)
                    req.kv_source = None
        if req.status is not RequestStatus.LOADING or req not in self._loads.values():
            self._kv.free(req)  # a load in flight writes its blocks: freed once it is reported
        req.status = FINISHED_STATUS[reason]
        req.epoch += 1
        req.num_output_placeholders = 0
        if req.in_worker:
            self._pending_finished.append(req.request_id)
            req.in_worker = False
        del self._requests[req.request_id]
        self._progressed()
        self._counts["num_finished"] += 1
        self._counts["num_aborted"] += reason is FinishReason.ABORT

    # ---- results -----------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, result: StepResult) -> StepEvents:
        """Commit the result of the oldest in-flight plan; returns the events of the requests
        that got a token (with its finish reason when it finished) or failed."""
        if not self._in_flight or self._in_flight[0].step_id != plan.step_id:
            oldest = self._in_flight[0].step_id if self._in_flight else None
            raise ValueError(f"plan {plan.step_id} is not the oldest in flight (oldest: {oldest})")
        if result.step_id != plan.step_id:
            raise ValueError(f"result for step {result.step_id} given with plan {plan.step_id}")
        record = self._in_flight[0]
        ordered = check_result(record, result, self.config.vocab_size, self.config.max_logprobs)
        self._in_flight.popleft()
        self._kv.device.release_fences(record.step_id)
        self._kv.host.release_fences(record.step_id)
        count_result(self._counts, result)
        events = self._committer.commit(record, result, ordered)
        if len(events):
            self._progressed()
        else:
            self._steps_without_token += 1
        return events

    # ---- progress ------------------------------------------------------------------------------
    def _progressed(self) -> None:
        self._steps_without_token = 0
        self._preemptions_at_progress = self._counts["num_preemptions"]

    def stall(self) -> str | None:
        """Why no request has got a token (or ended) in the last committed steps, once they
        are more than `stall_limit` allows; None while the core makes progress. A core that
        only throws work away (a preempt / readmit cycle) reports here instead of spinning."""
        if self._steps_without_token <= self._stall_limit or not self._requests:
            return None
        now = self._clock()
        most = max(self._requests.values(), key=lambda r: r.num_preemptions)
        aged = sum(self._policy.is_aged(r, now) for r in self._waiting.requests())
        kv = self._kv.device
        return (f"no request got a token in the last {self._steps_without_token} committed steps (at most "
                f"{self._stall_limit} without lost work); "
                f"{self._counts['num_preemptions'] - self._preemptions_at_progress} preemptions meanwhile, "
                f"{most.request_id!r} preempted {most.num_preemptions} times in all; {len(self._running)} running, "
                f"{len(self._waiting)} waiting ({aged} aged), {len(self._swapped)} swapped; {kv.num_free} free "
                f"and {kv.num_fenced} fenced device blocks; {len(self._in_flight)} plans in flight")

    # ---- introspection -------------------------------------------------------------------------
    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def waiting_requests(self) -> list[Request]:
        return self._waiting.requests()

    def queue_lengths(self) -> tuple[int, int]:  # (running, waiting), for the flight recorder per step
        return len(self._running), len(self._waiting) + len(self._preparing)

    def stats(self) -> SchedulerStats:
        return build_stats(self._kv, self._counts, len(self._running), len(self._waiting) + len(self._preparing),
                           len(self._swapped), len(self._in_flight), len(self._loading))

    def check_integrity(self) -> None:
        """Pool accounting, ref counts vs owners, queue membership, per-request counters."""
        held = [blocks for blocks, _ in self._held.values()]  # handed off: still this core's blocks
        held += [req.owned_block_ids for req in self._loads.values() if req.is_finished]  # aborted while loading
        check_core(self.config, self._requests, self._running, self._swapped, self._waiting, self._kv,
                   [p.step_id for p in self._in_flight], self._next_step_id, list(self._loading.values()), held,
                   [req for req, _ in self._preparing.values()])
        if any(self._preparing.get(req.request_id, (None,))[0] is not req for req in self._to_prepare):
            raise AssertionError("a request to prepare is not PREPARING")
        if any(req.request_id not in self._loading for req in self._loaded):
            raise AssertionError("a loaded request is not LOADING")


def stall_limit(config: SchedulerConfig) -> int:
    """Committed steps without a token that a core making progress never exceeds: prefilling
    `max_num_seqs` requests of `max_model_len` tokens one after another, a chunk a step, and
    the plans in flight (without preemption every step computes a full chunk of someone's
    prefill, or some request samples)."""
    chunk = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or config.max_num_batched_tokens)
    return config.max_num_seqs * cdiv(config.max_model_len, chunk) + config.max_in_flight
