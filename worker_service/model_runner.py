"""`ModelRunner.execute(plan) -> StepResult`: the worker's side of the step-plan contract.

See the top of `stepahead/plan.py` for the semantics. The runner never allocates blocks; it
keeps per-request token lists and block tables, the paged KV cache, and the previous step's
sampled ids on the device (placeholder decode inputs are gathered from them on the device).

A plan that fails validation (`plan_checks.PlanError`, a ValueError naming the request)
changes nothing beyond its finished/preempted forgets. A placeholder decode must be for a
request that sampled in the immediately preceding plan.

For tests, `last_logits` holds the float32 logits `[num_sampled, vocab]` of the last step's
sampling rows, `last_logits_ids` the matching request ids (`logits_of(request_id)` picks one).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from stepahead.logprobs import MAX_LOGPROBS
from stepahead.plan import GrammarReady, NewRequest, RunningRequest, StepPlan, StepResult, WorkerTiming
from stepahead.speculative import SpeculativeConfig
from worker_service import cpu_kernels
from worker_service.attention import AttentionBackend, AttentionMetadata
from worker_service.attention_names import AttentionBackendName
from worker_service.decode_graphs import DecodeGraphs, GraphSettings
from worker_service.grammar import DEFAULT_CACHE_SIZE, GrammarCache, GrammarMasks, split_bad_grammars
from worker_service.input_batch import (BuildConfig, CachedRequest, RequestTable, ScheduledBatch, StepBuffers,
                                        StepInputs, build_inputs)
from worker_service.kv_cache import KVCache, cpu_kv_cache_bytes, plan_num_blocks
from worker_service.layers.attention import ForwardContext
from worker_service.layers.packed_linear import pack_linears, packing_supported
from worker_service.layers.rotary import RotaryTable
from worker_service.loader import load_model, parse_dtype
from worker_service.logits_processing import LogitsProcessing, mask_stops_before_min_tokens
from worker_service.logprobs import LogprobsTracker, StepLogprobs
from worker_service.memory_profile import MemorySplit, profile_memory
from worker_service.model_config import RopeConfig, host_memory_bytes, resolve_max_model_len
from worker_service.models import family
from worker_service.paged_attention import make_backend
from worker_service.pending_step import PendingStep, copy_to_host
from worker_service.plan_checks import check_plan, kv_loader_for, split_bad_sampling_rows
from worker_service.sampler import Sampler, SamplingMetadata
from worker_service.speculation import SpecOutputs, Speculator
from worker_service.streams import DeviceStreams, StepEvent

log = logging.getLogger(__name__)


def isolate(run: Callable[[slice], object], reqs: Sequence[CachedRequest], what: str, batched: bool = True
            ) -> tuple[list[tuple[slice, object]], dict[str, str]]:
    """Per-request failure isolation of a step's per-request work (drafting, sampling: the stop
    mask, bias and penalties, the grammar mask, raw logprobs, speculative verification).

    `run(rows)` does the work of `reqs[rows]` and returns its result. One batched pass; should
    it raise, each request runs alone, and each one that raises again fails with its own
    exception as the reason, while the step and the other requests go on with exactly their
    results (`run` must leave its inputs intact: a retry starts clean). Returns the (rows,
    result) of the passes that succeeded, in order, and {request id: reason} of the failures.
    `batched=False`: the work is per request anyway, straight to one pass each.
    """
    if batched:
        rows = slice(0, len(reqs))
        try:
            return [(rows, run(rows))], {}
        except Exception as exc:  # retried request by request below: the failing ones get their reasons
            log.warning("%s failed for a batch of %d requests (%r); retried request by request", what, len(reqs),
                        exc)
    parts, failed = [], {}
    for i, r in enumerate(reqs):
        rows = slice(i, i + 1)
        try:
            parts.append((rows, run(rows)))
        except Exception as exc:  # this request alone fails: it ends with the reason
            failed[r.request_id] = f"{what} failed: {exc!r}"[:500]
    return parts, failed


class ModelRunner:
    """A `runners.Runner` on torch: one model, its paged KV cache and the sampler on one device."""

    computes_logprobs = True
    supports_structured_outputs = True

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 block_size: int = 16, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, num_blocks: int | None = None,
                 num_host_blocks: int = 0, num_offload_blocks: int = 0, max_model_len: int | None = None,
                 attention_backend: AttentionBackend | None = None, seed: int = 0,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 pad_decode_batches: bool | None = None, max_logprobs: int = MAX_LOGPROBS,
                 speculative_config: SpeculativeConfig | None = None,
                 structured_outputs_cache_size: int = DEFAULT_CACHE_SIZE, enforce_eager: bool = True,
                 pack_weights: bool = True, decode_graphs: GraphSettings | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and max_num_batched_tokens "
                             f"({max_num_batched_tokens}) must be positive")
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.model, cfg = self._load_model(model_dir)  # model.config: the KV geometry (a shard's under TP)
        self.config = cfg
        # on a CPU: the linears' weights in oneDNN's packed layout (layers/packed_linear.py)
        self.packed_linears = (pack_linears(self.model) if pack_weights and packing_supported(self.device, self.dtype)
                               else 0)
        if self.packed_linears:
            log.info("%d linear layers packed for oneDNN's CPU matmul (--no-cpu-prepack-weights: plain F.linear)",
                     self.packed_linears)
        # on a CPU, float32: norms, rotary and SiLU·mul as one-pass C++ kernels (cpu_kernels.py)
        kernels = cpu_kernels.load() if cpu_kernels.usable(self.device, self.dtype) else None
        self.cpu_layer_ops = cpu_kernels.attach_layer_ops(self.model, kernels) if kernels is not None else 0
        self.model_type, self.vocab_size, self.eos_token_ids = cfg.model_type, cfg.vocab_size, cfg.eos_token_ids
        self.max_model_len = resolve_max_model_len(cfg, max_model_len)
        self.sliding_window = cfg.kv_window or 0  # announced in the hello (`WorkerInfo.sliding_window`)
        self.block_size = block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_blocks_per_req = -(-self.max_model_len // block_size)
        # positions by rope (cos/sin gathered per step), or embedded by the model itself (GPT-2)
        self.rotary = (RotaryTable(cfg.rope, cfg.head_dim, self.max_model_len, self.dtype, self.device)
                       if family(cfg.model_type).rope else None)
        # the sliding layers' own rope base (Gemma 3's rope_local_base_freq), plain rope
        self.local_rotary = (RotaryTable(RopeConfig(theta=cfg.rope_local_theta), cfg.head_dim, self.max_model_len,
                                         self.dtype, self.device)
                             if self.rotary is not None and cfg.rope_local_theta is not None else None)
        self.backend = attention_backend or make_backend(AttentionBackendName.AUTO, self.device, self.dtype,
                                                         block_size)
        # the model's forward(input_ids, ctx): eager, or compiled (warmed up below, once the KV cache exists)
        self.enforce_eager = enforce_eager
        self._run_model = self.model
        if not enforce_eager:
            from worker_service.compiled import compile_forward

            self._run_model = compile_forward(self.model)
        self.sampler = Sampler(self.device, seed=seed)
        self.logits_processing = LogitsProcessing(self.vocab_size, self.device)  # bias, penalties
        self.grammar = GrammarMasks(GrammarCache(model_dir, self.vocab_size, self.eos_token_ids,
                                                 structured_outputs_cache_size), self.device)
        # where a plan's prepared grammars are reported (`GrammarReady`): the attach session's
        # stream, set per session on rank 0; None: they are compiled and not reported
        self.grammar_report: Callable[[GrammarReady], None] | None = None
        self.logprobs = LogprobsTracker(self.device)
        self.max_logprobs = min(max_logprobs, self.vocab_size)  # --max-logprobs
        self.streams = DeviceStreams(self.device)
        self.speculator = Speculator(speculative_config, self.eos_token_ids, self.grammar) if speculative_config else None
        self._spec_out: SpecOutputs | None = None  # between verification and the D2H copy
        self.pad_decode_batches = self.streams.cuda if pad_decode_batches is None else pad_decode_batches
        self.requests: dict[str, CachedRequest] = {}
        self._num_min_tokens = 0  # live requests with min_tokens > 0 (the stop-id mask is skipped without)
        # two of everything a step writes and a later step reuses, indexed by step parity
        self.buffers = [StepBuffers(self.device, max_num_batched_tokens, max_num_seqs, self.max_blocks_per_req)
                        for _ in range(2)]
        self._sampled = torch.zeros(2, max_num_seqs, dtype=torch.int64, device=self.device)
        self._host_ids = torch.zeros(2, max_num_seqs, dtype=torch.int64, pin_memory=self.streams.cuda)
        self._compute_done = [StepEvent(), StepEvent()]  # W1: the slot's device inputs are free
        self._inputs_copied = [StepEvent(), StepEvent()]  # H1: the slot's pinned host inputs are free
        self._pending: list[PendingStep | None] = [None, None]  # H2: the slot's sampled ids' reader
        self._num_launched = 0
        self.kv_cache = KVCache(self.model.config, num_blocks=0, num_host_blocks=0, block_size=block_size, dtype=self.dtype,
                                device=self.device)  # the dummy block only, for the profiling run
        self.memory_split: MemorySplit | None = None  # set when the KV cache was sized by profiling
        if num_blocks is None and kv_cache_bytes is None and self.streams.cuda:
            self.memory_split = profile_memory(self, gpu_memory_utilization)
            kv_cache_bytes = self.memory_split.kv_cache
        elif num_blocks is None and kv_cache_bytes is None:  # the host is the device's memory
            kv_cache_bytes = cpu_kv_cache_bytes(self.model.config, block_size, self.dtype,
                                                available_bytes=host_memory_bytes(), max_num_seqs=max_num_seqs,
                                                max_model_len=self.max_model_len)
        self.num_blocks = plan_num_blocks(self.model.config, block_size, self.dtype, kv_cache_bytes=kv_cache_bytes,
                                          num_blocks=num_blocks)
        self.num_host_blocks = num_host_blocks
        self.num_offload_blocks = min(num_offload_blocks, num_host_blocks)  # of them, for the prefix cache's host tier
        self.kv_cache = KVCache(self.model.config, num_blocks=self.num_blocks, num_host_blocks=num_host_blocks,
                                block_size=block_size, dtype=self.dtype, device=self.device)
        self.table = RequestTable(self.max_blocks_per_req, self.kv_cache.dummy_block)
        self._prev_sampled = self._sampled[0, :0]  # [n] last step's ids (a view of one slot)
        self._prev_rows: dict[str, int] = {}  # request id -> row in _prev_sampled
        self._failed_ids: set[str] = set()  # failed here; the scheduler has not yet said forget
        self._step_lp: StepLogprobs | None = None  # the launching step's logprob work
        self.last_logits: torch.Tensor | None = None
        self.last_logits_ids: tuple[str, ...] = ()
        self.streams.wait_for_constructor()  # W0
        self.warm_up_seconds = 0.0  # compiling the forward at start-up (0 when eager)
        self.graphs: DecodeGraphs | None = None  # set below, after the warm-up
        if not enforce_eager:
            from worker_service.compiled import warm_up

            self.warm_up_seconds = warm_up(self)
        # decode-only steps of these batch sizes replayed from captured graphs (decode_graphs.py)
        if decode_graphs is not None and decode_graphs.sizes:
            if not getattr(self.backend, "graph_safe", False):
                raise ValueError(f"decode graphs need a graph-safe attention backend (--attention-backend paged), "
                                 f"not {type(self.backend).__name__}")
            if not self.pad_decode_batches:
                raise ValueError("decode graphs need decode batches padded to their buckets")
            self.graphs = DecodeGraphs(decode_graphs, self._hidden, self.buffers[0], block_size)

    def _load_model(self, model_dir):
        return load_model(model_dir, self.dtype, self.device)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to completion (launch, then wait for its sampled ids)."""
        return self.launch(plan).wait()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, received: float = 0.0) -> PendingStep:
        """Queue a step's device work; returns before its sampled ids reach the host on CUDA.

        Steps must be launched in plan order. The next step may be launched at once: a
        placeholder decode reads the sampled ids this step left on the device. Everything
        runs on the runner's compute stream, whichever thread calls this.
        """
        prep_start = time.time()
        self._forget(plan.finished_ids)
        self._forget(plan.preempted_ids)
        if plan.grammars:  # compiled in the background, each reported on the attach stream
            self.grammar.prepare(plan.grammars, self.vocab_size, self.grammar_report)
        plan, failed = split_bad_sampling_rows(plan, self.vocab_size, self._failed_ids, self.max_logprobs)
        plan, invalid = split_bad_grammars(plan, self.grammar, self._failed_ids, failed)
        if self.speculator is not None:
            self.speculator.resolve_before(plan, self._pending)
        check_plan(plan, self.requests, self._prev_rows, num_blocks=self.num_blocks, block_size=self.block_size,
                   max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        loader = kv_loader_for(plan, self.kv_loader, self.num_blocks) if plan.kv_loads else None
        with self.streams.on_compute_stream():
            self.kv_cache.swap_out(plan.swap_out)
            self.kv_cache.swap_in(plan.swap_in)
            if loader is not None:  # in the background; their writes come after the swaps (W4)
                loader.start(plan.kv_loads)
            sched = self._schedule(plan.new_requests, plan.running, failed)
            if not sched:
                self._set_sampled([], self._sampled[0, :0])
                now = time.time()
                return PendingStep(plan.step_id, [], [], self._host_ids[0, :0], StepEvent(),
                                   WorkerTiming(received or prep_start, prep_start, now, now), failed, invalid)
            slot = self._num_launched & 1
            self._num_launched += 1
            inputs = self._copy_inputs(sched, slot)
            self._step_lp = self.logprobs.begin_step(sched)  # None when no live request asks
            if self.speculator is not None and self.speculator.batch is not None:
                self.speculator.strip(sched.states)  # drafts leave the token lists; rows for each position
                inputs = replace(inputs, logits_indices=self.speculator.logits_indices(inputs.sampling_reqs,
                                                                                      inputs.logits_indices))
            for state, n in zip(sched.states, sched.num_scheduled):
                state.num_computed += n
            forward_start = time.time()
            sampled, reqs = self._device_step(inputs, slot, failed)
            slots = self._reserve_slots(reqs)
            pending = self._to_host(sampled, slot, plan.step_id, reqs, slots, self._step_lp)
            pending.failed, pending.invalid_ids = failed, invalid
        forward_end = 0.0 if self.streams.cuda else time.time()  # CPU: the work is done here
        pending.timing = WorkerTiming(received or prep_start, prep_start, forward_start, forward_end)
        return pending

    def _copy_inputs(self, sched: ScheduledBatch, slot: int) -> StepInputs:
        """Fill the slot's pinned arena and copy it to the device on the copy stream."""
        # The copy of step t-2 read this slot's pinned arena. With two steps in flight (the
        # scheduler's window, unless it deepened) its result was already reported, so this does
        # not block; with three it may wait for that copy.
        self._inputs_copied[slot].synchronize()  # H1
        with self.streams.on_copy_stream():
            self.streams.copy_waits_for_compute(self._compute_done[slot])  # W1
            regrown = self.buffers[slot].regrown
            cfg = BuildConfig(self.block_size, self.kv_cache.dummy_block, self.pad_decode_batches)
            inputs = build_inputs(self.buffers[slot], self.table, sched, cfg, self._prev_rows)
            if self.buffers[slot].regrown != regrown:
                log.warning("step input buffers regrown beyond max_num_seqs / max_num_batched_tokens; "
                            "their addresses changed (slot %d)", slot)
            self._inputs_copied[slot] = self.streams.record("copy")
        self.streams.compute_waits_for_copies()  # W2
        return inputs

    def _device_step(self, inputs: StepInputs, slot: int, failed: dict[str, str]
                     ) -> tuple[torch.Tensor, list[CachedRequest]]:
        """Forward + sampling on the compute stream; returns the slot's sampled ids `[n]` and
        the n requests that sampled (a request whose sampling fails alone is added to `failed`)."""
        self._fill_placeholders(inputs)
        logits = self._forward(inputs, self.buffers[slot])  # [num_sampling (+ drafts), vocab] float32
        spec = self.speculator.batch if self.speculator is not None else None
        if spec is not None:  # sampled: [len(reqs)] the last token of each run; the runs go to the host
            sampled, reqs, sample_failed = self._verify(logits, inputs.sampling_reqs)
        else:
            sampled, reqs, sample_failed = self._sample(logits, inputs.sampling_reqs)  # [len(reqs)] int64
        self._fail(sample_failed, failed)
        self._retire(slot)  # H2: also orders the write below after that step's D2H
        self._ensure_sampled_capacity(len(sampled))
        out = self._sampled[slot, : len(sampled)]
        out.copy_(sampled)
        self._compute_done[slot] = self.streams.record("compute")
        self._set_sampled(reqs, out)
        return out, reqs

    def _ensure_sampled_capacity(self, rows: int) -> None:
        """Grow the sampled-ids buffers for a plan beyond max_num_seqs (rare; addresses change)."""
        if rows <= self._sampled.shape[1]:
            return
        log.warning("sampled-ids buffers regrown to %d rows (beyond max_num_seqs)", rows)
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)  # in-flight copies still read the old buffers
        prev = self._sampled  # kept alive by _prev_sampled, which this step still reads
        self._sampled = torch.zeros(2, 2 * rows, dtype=torch.int64, device=self.device)
        self._host_ids = torch.zeros(2, 2 * rows, dtype=torch.int64, pin_memory=self.streams.cuda)
        del prev

    def _retire(self, slot: int) -> None:
        """The step two back must have read its host ids before this one reuses the buffers
        (never blocks with two plans in flight; with three, as the adaptive window plans when the
        device waits for plans, it waits here for that step's ids)."""
        old, self._pending[slot] = self._pending[slot], None
        if old is not None:
            old.ids()

    def _to_host(self, sampled: torch.Tensor, slot: int, step_id: int, reqs, slots,
                 lp: StepLogprobs | None) -> PendingStep:
        """D2H of the sampled ids (and logprobs, a speculative step's runs) into pinned buffers."""
        spec_dev, self._spec_out = self._spec_out, None
        pending = copy_to_host(self.streams, sampled, self._host_ids[slot, : len(sampled)], step_id, reqs, slots,
                               lp, spec_dev)
        self._pending[slot] = pending
        return pending

    def reset(self) -> None:
        """Forget every request and the device-side sampled ids (e.g. after a scheduler reconnect)."""
        for rid in list(self.requests):
            self._forget((rid,))
        with self.streams.on_compute_stream():  # its buffers are zeroed where the steps use them
            self.logits_processing = LogitsProcessing(self.vocab_size, self.device)
        self.grammar.clear()
        self._failed_ids.clear()
        self._pending = [None, None]
        self._spec_out = None
        self._set_sampled([], self._sampled[0, :0])
        self.last_logits, self.last_logits_ids = None, ()

    # -- KV transfers (disaggregation: `kv_transfer` serves reads, `kv_loads` writes) -----------

    holds_kv = True  # KV chunks carry the blocks' bytes
    kv_loader = None  # the attach session's `kv_loads.KVLoader`: plans with kv_loads need one

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_cache.bytes_per_block

    def read_kv_blocks(self, block_ids: list[int]) -> bytes:
        """The bytes of device blocks (`KVCache.read_blocks`' layout), from any thread while steps
        run: the scheduler keeps every plan off the blocks while they are read; on CUDA the read
        runs on the transfer stream after every step launched so far."""
        with torch.inference_mode(), self.streams.on_transfer_stream():
            self.streams.transfer_waits_for_compute()
            return self.kv_cache.read_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Device blocks from another worker's `read_kv_blocks`, from a loader thread while steps
        run (no plan touches them until the load is reported); on the device when this returns.
        On CUDA it follows every step launched so far (a swap-out of the blocks' former contents)."""
        with torch.inference_mode(), self.streams.on_transfer_stream():
            self.streams.transfer_waits_for_compute()
            self.kv_cache.write_blocks(block_ids, data)
            self.streams.synchronize_transfer()

    def kv_link_seconds(self, nbytes: int) -> float:
        """Extra time a load of `nbytes` waits (a real link took its own time): none."""
        return 0.0

    def logits_of(self, request_id: str) -> torch.Tensor:
        """The last step's logits `[vocab]` for a request that sampled in it."""
        return self.last_logits[self.last_logits_ids.index(request_id)]

    # -- plan application -------------------------------------------------------------

    def _forget(self, ids: tuple[str, ...]) -> None:
        for rid in ids:  # forgetting an unknown id is a no-op (e.g. aborted before first step)
            state = self.requests.pop(rid, None)
            if state is not None:
                self.table.free(state.row)
                self._num_min_tokens -= state.sampling.min_tokens > 0
                self.logprobs.forget(state)
            self.logits_processing.forget(rid)
            self.grammar.forget(rid)
            self._failed_ids.discard(rid)

    def _fail(self, newly: dict[str, str], failed: dict[str, str]) -> None:
        """Requests that failed alone this step: forget them, skip their later deltas."""
        self._forget(tuple(newly))
        self._failed_ids.update(newly)
        failed.update(newly)

    def _schedule(self, new: tuple[NewRequest, ...], running: tuple[RunningRequest, ...],
                  failed: dict[str, str]) -> ScheduledBatch:
        """Registers new requests, applies deltas; decodes (one-token queries) first. A request
        whose drafting fails fails alone (added to `failed`) and stays out of the batch."""
        decodes, chunks = ScheduledBatch(), ScheduledBatch()
        if self.speculator is not None:
            self.speculator.batch = None
        for r in new:
            num_prompt = len(r.token_ids) if r.num_prompt_tokens is None else r.num_prompt_tokens
            state = CachedRequest(r.request_id, list(r.token_ids), r.sampling, list(r.block_ids),
                                  r.num_computed_tokens, num_prompt)
            state.row = self.table.add(state.block_ids)
            self.requests[r.request_id] = state
            self.logits_processing.register(r.request_id, r.sampling, r.token_ids, num_prompt)
            self._num_min_tokens += r.sampling.min_tokens > 0
            self.logprobs.register(state)
            n = r.num_scheduled_tokens
            (decodes if n == 1 else chunks).add(state, n, False)
        requests = self.requests
        d_states, d_placeholder = decodes.states, decodes.placeholder
        for r in running:
            state = requests[r.request_id]
            if r.new_block_ids:
                self.table.extend(state.row, r.new_block_ids)
                state.block_ids.extend(r.new_block_ids)
            n, placeholder = r.num_scheduled_tokens, r.input_is_placeholder
            if r.num_draft_tokens and self.speculator:  # its input is known once the last step resolved
                drafted, newly = isolate(lambda _, st=state, rr=r: self.speculator.draft(st, rr), [state],
                                         "drafting", batched=False)
                if newly:
                    self._fail(newly, failed)
                    continue
                n, placeholder = drafted[0][1]
            if n == 1:
                d_states.append(state)
                d_placeholder.append(placeholder)
            else:
                chunks.add(state, n, placeholder)
        decodes.num_scheduled = [1] * len(d_states)
        if self.speculator is not None:
            self.speculator.end_proposals()
        return decodes + chunks if len(chunks) else decodes

    # -- device work --------------------------------------------------------------------

    def _fill_placeholders(self, inputs: StepInputs) -> None:
        """input_ids[dst] = previous step's sampled ids[src], on the device."""
        if len(inputs.placeholder_src):
            tokens = self._prev_sampled.index_select(0, inputs.placeholder_src)
            inputs.input_ids.index_copy_(0, inputs.placeholder_dst, tokens)

    def _forward(self, inputs: StepInputs, arena: StepBuffers | None = None) -> torch.Tensor:
        """Logits `[num_sampling, vocab]` of a step whose inputs are in `arena` (a decode-only step of a
        captured size replays its graph)."""
        hidden = self.graphs.run(inputs, arena) if self.graphs is not None and arena is not None else None
        if hidden is None:
            hidden = self._hidden(inputs.input_ids, inputs.meta)  # [num_tokens, hidden]
        if self._step_lp is not None:
            self._step_lp.prompt(hidden, self.model.compute_logits)
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def _hidden(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward without the head: input_ids `[n]` -> hidden states `[n, hidden]`."""
        positions = meta.positions
        cos, sin = self.rotary.lookup(positions) if self.rotary is not None else (None, None)
        local_cos, local_sin = self.local_rotary.lookup(positions) if self.local_rotary is not None else (None, None)
        ctx = ForwardContext(meta, self.backend, self.kv_cache.layers, cos, sin, local_cos, local_sin)
        return self._run_model(input_ids, ctx)

    def _sample(self, logits: torch.Tensor, reqs: list[CachedRequest]
                ) -> tuple[torch.Tensor, list[CachedRequest], dict[str, str]]:
        """logits [n, vocab] → (ids [m] int64 on the device, the m requests that sampled, failures).

        Sampling is one batched pass; should it raise (no valid row can make it: the rows
        were checked against the shared limits), the rows are sampled one by one and only
        those that fail again fail, each alone with its reason (`isolate`).
        """
        self.last_logits = logits
        self.last_logits_ids = tuple(r.request_id for r in reqs)
        if not reqs:
            return torch.zeros(0, dtype=torch.int64, device=self.device), [], {}
        parts, failed = isolate(lambda rows: self._sample_rows(logits[rows], reqs[rows]), reqs, "sampling")
        good = [r for rows, _ in parts for r in reqs[rows]]
        ids = [sampled for _, sampled in parts]  # [len(rows)] each
        if len(ids) == 1:  # the batched pass: no copy
            return ids[0], good, failed
        return (torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=self.device)), good, failed

    def _sample_rows(self, logits: torch.Tensor, reqs: list[CachedRequest]) -> torch.Tensor:
        """logits [m, vocab] (left intact) → ids [m]: every per-request stage of a plain step,
        the penalty counts recorded last (once the rows sampled, nothing can fail them)."""
        lp = self._step_lp
        if lp is not None:
            lp.raw(logits, reqs)  # raw logprobs: before the stop mask, bias and penalties
        if self._num_min_tokens:  # live requests with min_tokens (usually none)
            logits = mask_stops_before_min_tokens(logits, reqs, self.eos_token_ids)
        # each row passed stepahead.limits when its request was admitted (split_bad_sampling_rows)
        params = [r.sampling for r in reqs]
        meta = SamplingMetadata.build(params, [len(r.token_ids) for r in reqs], self.vocab_size, self.device,
                                      validated=True)
        # bias and penalties (a new tensor, or `logits` itself when no row uses them)
        processed = self.logits_processing.apply(logits, [r.request_id for r in reqs], params)
        processed = self.grammar.apply(processed, reqs, self._settle_placeholders)  # structured outputs
        sampled = self.sampler(processed, meta)
        if lp is not None:
            lp.sampled(sampled, reqs, reqs)
        self.logits_processing.record(sampled)  # penalty counts see this step's ids, on the device
        return sampled

    def _verify(self, logits: torch.Tensor, reqs: list[CachedRequest]
                ) -> tuple[torch.Tensor, list[CachedRequest], dict[str, str]]:
        """A speculative step: logits [rows, vocab] (each request's 1 + k rows in order) →
        (last ids [m], the m requests verified, failures), isolated like `_sample`; the runs
        wait in `_spec_out` for the D2H copy."""
        self.last_logits, self.last_logits_ids = logits, tuple(r.request_id for r in reqs)
        drafts = self.speculator.batch.drafts
        first = list(itertools.accumulate([len(drafts.get(r.request_id, ())) + 1 for r in reqs], initial=0))

        def verify(rows: slice):
            return self.speculator.verify(self, logits[first[rows.start] : first[rows.stop]], reqs[rows],
                                          self._step_lp)

        parts, failed = isolate(verify, reqs, "sampling")
        good = [r for rows, _ in parts for r in reqs[rows]]
        last = [ids for _, (ids, _) in parts]  # [len(rows)] each
        self._spec_out = SpecOutputs.concat([out for _, (_, out) in parts], self.device)
        return (torch.cat(last) if last else torch.zeros(0, dtype=torch.int64, device=self.device)), good, failed

    def _settle_placeholders(self) -> None:
        """Put the sampled ids of steps still in flight into their requests' token lists."""
        for pending in self._pending:
            if pending is not None:
                pending.ids()

    def _set_sampled(self, reqs: list[CachedRequest], sampled: torch.Tensor) -> None:
        """sampled: [len(reqs)] a view of one slot of the persistent sampled-ids buffer."""
        self._prev_sampled = sampled
        self._prev_rows = {r.request_id: i for i, r in enumerate(reqs)}

    @staticmethod
    def _reserve_slots(reqs: list[CachedRequest]) -> list[int]:
        """Append a slot per sampled token; wait() fills it once the id is on the host.

        Until then the slot is only ever read through the device (placeholder decodes).
        """
        slots = []
        for r in reqs:
            slots.append(len(r.token_ids))
            r.token_ids.append(-1)
        return slots

