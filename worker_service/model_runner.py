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

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from stepahead.plan import NewRequest, RunningRequest, StepPlan, StepResult, WorkerTiming
from worker_service.attention import AttentionBackend, TorchAttentionBackend
from worker_service.input_batch import CachedRequest, ScheduledRequest, StepBuffers, StepInputs, build_inputs
from worker_service.kv_cache import KVCache, plan_num_blocks
from worker_service.loader import load_model, parse_dtype
from worker_service.logits_processing import LogitsProcessing
from worker_service.models.llama import ForwardContext
from worker_service.plan_checks import check_plan, split_bad_sampling_rows
from worker_service.rope import RotaryTable
from worker_service.sampler import Sampler, SamplingMetadata
from worker_service.streams import DeviceStreams, StepEvent


@dataclass
class PendingStep:
    """A launched step whose sampled ids may still be on their way to the host."""

    step_id: int
    reqs: list[CachedRequest]  # sampling requests, in row order
    slots: list[int]  # index in each request's token_ids reserved for its sampled id
    host_ids: torch.Tensor  # [num_sampling] int64, valid once `done` completed
    done: StepEvent
    timing: WorkerTiming  # forward_end is set by wait() on CUDA
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed alone

    def wait(self) -> StepResult:
        """Block until the ids are on the host (the step's one sync); fill the token lists."""
        self.done.synchronize()
        timing = self.timing if self.timing.forward_end else replace(self.timing, forward_end=time.time())
        ids = self.host_ids.tolist()
        for r, slot, t in zip(self.reqs, self.slots, ids):
            r.token_ids[slot] = t
        return StepResult(self.step_id, {r.request_id: t for r, t in zip(self.reqs, ids)}, timing, self.failed)


class ModelRunner:
    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 block_size: int = 16, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, num_blocks: int | None = None,
                 num_host_blocks: int = 0, max_model_len: int | None = None,
                 attention_backend: AttentionBackend | None = None, seed: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.model, cfg = load_model(model_dir, self.dtype, self.device)
        self.config = cfg
        self.model_type, self.vocab_size, self.eos_token_ids = cfg.model_type, cfg.vocab_size, cfg.eos_token_ids
        self.max_model_len = _max_model_len(cfg, max_model_len)
        self.block_size = block_size
        self.num_blocks = plan_num_blocks(cfg, block_size, self.dtype, self.device, kv_cache_bytes=kv_cache_bytes,
                                          gpu_memory_utilization=gpu_memory_utilization, num_blocks=num_blocks)
        self.num_host_blocks = num_host_blocks
        self.kv_cache = KVCache(cfg, num_blocks=self.num_blocks, num_host_blocks=num_host_blocks,
                                block_size=block_size, dtype=self.dtype, device=self.device)
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, self.max_model_len, self.dtype, self.device)
        self.backend = attention_backend or TorchAttentionBackend()
        self.sampler = Sampler(self.device, seed=seed)
        self.logits_processing = LogitsProcessing(self.vocab_size, self.device)  # bias, penalties
        self.requests: dict[str, CachedRequest] = {}
        self.buffers = StepBuffers(self.device)
        self.streams = DeviceStreams(self.device)
        self._inputs_copied = StepEvent()  # guards the pinned host input buffers
        self._prev_sampled = torch.zeros(0, dtype=torch.int64, device=self.device)  # [n] last step's ids
        self._prev_rows: dict[str, int] = {}  # request id -> row in _prev_sampled
        self._failed_ids: set[str] = set()  # failed here; the scheduler has not yet said forget
        self.last_logits: torch.Tensor | None = None
        self.last_logits_ids: tuple[str, ...] = ()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to completion (launch, then wait for its sampled ids)."""
        return self.launch(plan).wait()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, received: float = 0.0) -> PendingStep:
        """Queue a step's device work; returns before its sampled ids reach the host on CUDA.

        Steps must be launched in plan order. The next step may be launched at once: a
        placeholder decode reads the sampled ids this step left on the device.
        """
        prep_start = time.time()
        self._forget(plan.finished_ids)
        self._forget(plan.preempted_ids)
        plan, failed = split_bad_sampling_rows(plan, self.vocab_size, self._failed_ids)
        check_plan(plan, self.requests, self._prev_rows, num_blocks=self.num_blocks,
                   block_size=self.block_size, max_model_len=self.max_model_len)
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        sched = self._schedule(plan.new_requests, plan.running)
        if not sched:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            self._set_sampled([], empty)
            now = time.time()
            return PendingStep(plan.step_id, [], [], empty.cpu(), StepEvent(),
                               WorkerTiming(received or prep_start, prep_start, now, now), failed)
        inputs = self._copy_inputs(sched)
        for s in sched:
            s.state.num_computed += s.num_scheduled
        forward_start = time.time()
        self._fill_placeholders(inputs)
        logits = self._forward(inputs)  # [num_sampling, vocab] float32
        sampled, reqs, sample_failed = self._sample(logits, inputs.sampling_reqs)  # [len(reqs)] int64
        self._fail(sample_failed, failed)
        self._set_sampled(reqs, sampled)
        slots = self._reserve_slots(reqs)
        host_ids, done = self.streams.to_host(sampled)
        forward_end = 0.0 if self.streams.cuda else time.time()  # CPU: the work is done here
        timing = WorkerTiming(received or prep_start, prep_start, forward_start, forward_end)
        return PendingStep(plan.step_id, reqs, slots, host_ids, done, timing, failed)

    def _copy_inputs(self, sched: list[ScheduledRequest]) -> StepInputs:
        """Fill the pinned host buffers and copy them to the device on the copy stream."""
        self._inputs_copied.synchronize()  # the previous step's H2D copies read these buffers
        self.streams.copy_waits_for_main()  # device buffers: the previous step's compute is done
        with self.streams.on_copy_stream():
            inputs = build_inputs(self.buffers, sched, self.block_size, self._prev_rows)
        self._inputs_copied = self.streams.record("copy")
        self.streams.main_waits_for_copies()
        return inputs

    def reset(self) -> None:
        """Forget every request and the device-side sampled ids (e.g. after a scheduler reconnect)."""
        self.requests.clear()
        self.logits_processing = LogitsProcessing(self.vocab_size, self.device)
        self._failed_ids.clear()
        self._set_sampled([], torch.zeros(0, dtype=torch.int64, device=self.device))
        self.last_logits, self.last_logits_ids = None, ()

    def logits_of(self, request_id: str) -> torch.Tensor:
        """The last step's logits `[vocab]` for a request that sampled in it."""
        return self.last_logits[self.last_logits_ids.index(request_id)]

    # -- plan application -------------------------------------------------------------

    def _forget(self, ids: tuple[str, ...]) -> None:
        for rid in ids:  # forgetting an unknown id is a no-op (e.g. aborted before first step)
            self.requests.pop(rid, None)
            self.logits_processing.forget(rid)
            self._failed_ids.discard(rid)

    def _fail(self, newly: dict[str, str], failed: dict[str, str]) -> None:
        """Requests that failed alone this step: forget them, skip their later deltas."""
        for rid in newly:
            self.requests.pop(rid, None)
            self.logits_processing.forget(rid)
        self._failed_ids.update(newly)
        failed.update(newly)

    def _schedule(self, new: tuple[NewRequest, ...], running: tuple[RunningRequest, ...]) -> list[ScheduledRequest]:
        """Registers new requests, applies deltas; decodes (one-token queries) first."""
        sched = []
        for r in new:
            num_prompt = len(r.token_ids) if r.num_prompt_tokens is None else r.num_prompt_tokens
            state = CachedRequest(r.request_id, list(r.token_ids), r.sampling, list(r.block_ids),
                                  r.num_computed_tokens, num_prompt)
            self.requests[r.request_id] = state
            self.logits_processing.register(r.request_id, r.sampling, r.token_ids, num_prompt)
            sched.append(ScheduledRequest(state, r.num_scheduled_tokens, placeholder=False))
        for r in running:
            state = self.requests[r.request_id]
            state.block_ids.extend(r.new_block_ids)
            sched.append(ScheduledRequest(state, r.num_scheduled_tokens, r.input_is_placeholder))
        sched.sort(key=lambda s: s.num_scheduled != 1)  # stable: decodes first
        return sched

    # -- device work --------------------------------------------------------------------

    def _fill_placeholders(self, inputs: StepInputs) -> None:
        """input_ids[dst] = previous step's sampled ids[src], on the device."""
        if len(inputs.placeholder_src):
            tokens = self._prev_sampled.index_select(0, inputs.placeholder_src)
            inputs.input_ids.index_copy_(0, inputs.placeholder_dst, tokens)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        cos, sin = self.rotary.lookup(inputs.meta.positions)
        ctx = ForwardContext(inputs.meta, self.backend, self.kv_cache.layers, cos, sin)
        hidden = self.model(inputs.input_ids, ctx)  # [num_tokens, hidden]
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def _sample(self, logits: torch.Tensor, reqs: list[CachedRequest]
                ) -> tuple[torch.Tensor, list[CachedRequest], dict[str, str]]:
        """logits [n, vocab] → (ids [m] int64 on the device, the m requests that sampled, failures).

        Sampling is one batched pass; should it raise (no valid row can make it: the rows
        were checked against the shared limits), the rows are sampled one by one and only
        those that fail again fail, each alone with its reason.
        """
        self.last_logits = logits
        self.last_logits_ids = tuple(r.request_id for r in reqs)
        if not reqs:
            return torch.zeros(0, dtype=torch.int64, device=self.device), [], {}
        self._mask_stops_before_min_tokens(logits, reqs)
        try:
            return self._sample_rows(logits, reqs), reqs, {}
        except Exception:  # isolated below, row by row; each failure is reported with its reason
            return self._sample_each_row(logits, reqs)

    def _sample_rows(self, logits: torch.Tensor, reqs: list[CachedRequest]) -> torch.Tensor:
        params = [r.sampling for r in reqs]
        meta = SamplingMetadata.build(params, [len(r.token_ids) for r in reqs], self.vocab_size, self.device)
        # bias and penalties (a new tensor, or `logits` itself when no row uses them)
        processed = self.logits_processing.apply(logits, [r.request_id for r in reqs], params)
        sampled = self.sampler(processed, meta)
        self.logits_processing.record(sampled)  # penalty counts see this step's ids, on the device
        return sampled

    def _sample_each_row(self, logits: torch.Tensor, reqs: list[CachedRequest]
                         ) -> tuple[torch.Tensor, list[CachedRequest], dict[str, str]]:
        good, ids, failed = [], [], {}
        for i, r in enumerate(reqs):
            try:
                ids.append(self._sample_rows(logits[i : i + 1], [r]))  # [1]
                good.append(r)
            except Exception as exc:  # this row alone fails: its request ends with the reason
                failed[r.request_id] = f"sampling failed: {exc!r}"[:500]
        sampled = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=self.device)
        return sampled, good, failed

    def _mask_stops_before_min_tokens(self, logits: torch.Tensor, reqs: list[CachedRequest]) -> None:
        """logits[row, stop ids] = -inf for rows still short of min_tokens (usually none)."""
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.sampling.min_tokens:
                stops = set(r.sampling.stop_token_ids)
                if not r.sampling.ignore_eos:
                    stops.update(self.eos_token_ids)
                ids = [t for t in stops if t < logits.shape[1]]
                rows += [i] * len(ids)
                cols += ids
        if rows:
            index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))

    def _set_sampled(self, reqs: list[CachedRequest], sampled: torch.Tensor) -> None:
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


def _max_model_len(cfg, requested: int | None) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None:
        limit = min(limit, cfg.sliding_window)  # no sliding-window attention: stay within it
    if requested is None:
        return limit
    if not 0 < requested <= limit:
        raise ValueError(f"max_model_len {requested} outside (0, {limit}] for this model")
    return requested

