"""`SimRunner`: executes step plans like `ModelRunner`, but the "device" is a clock.

Each plan is validated and applied to the same per-request state as the torch runner
(`plan_checks.check_plan`: the same rules), tokens come from `tokens.TokenRule`, and the
step's duration from `cost.CostModel`. The simulated device runs one step at a time:
a step starts when it is launched or when the previous one ends, whichever is later, and
`wait()` sleeps until its end on the monotonic clock (`time.sleep` releases the GIL and
uses no CPU). No torch anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stepahead.plan import NewRequest, RunningDeltas, SamplingParams, SpecOutcome, StepPlan, StepResult, WorkerTiming
from stepahead.speculative import SpeculativeConfig
from worker_service.model_config import ModelConfig
from worker_service.plan_checks import PlanError, check_plan, kv_loader_for, split_bad_sampling_rows
from worker_service.sim import tokens
from worker_service.sim.cost import CostModel, ModelGeometry
from worker_service.sim.profiles import BUILTIN_LINKS, AcceleratorProfile, LinkProfile


_ACCEPT_SALT = 0x5BEC_DEC0_DE5A_17ED  # acceptance draws differ from token draws


@dataclass(slots=True)
class SimRequest:
    """The attributes `check_plan` reads (as `CachedRequest`), plus the rolling history hash."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed: int
    num_prompt: int
    history_hash: int = field(default=0)


@dataclass
class SimPendingStep:
    """A launched step: its tokens are known; the result is due at `deadline` (monotonic)."""

    step_id: int
    sampled: dict[str, int]
    deadline: float
    busy_s: float
    timing: WorkerTiming
    wall_offset: float  # time.time() - time.monotonic() when the runner started
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed alone
    speculation: dict[str, SpecOutcome] = field(default_factory=dict)

    def wait(self) -> StepResult:
        delay = self.deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # releases the GIL; no CPU while the "device" computes
        timing = WorkerTiming(self.timing.plan_received, self.timing.prep_start, self.timing.forward_start,
                              self.deadline + self.wall_offset, 0.0, self.busy_s)
        return StepResult(self.step_id, self.sampled, timing, self.failed, speculation=self.speculation)


class SimRunner:
    """A `runners.Runner` on a simulated accelerator: launch / execute / reset."""

    # announced in the hello (WorkerHello.no_logprobs / no_structured_outputs): no logits, so
    # gateways refuse such requests up front with a reason instead of a bare finish "error"
    computes_logprobs = False
    supports_structured_outputs = False
    max_logprobs = 0
    sliding_window = 0  # the sim models attend to the whole context
    grammar = None  # no compiled grammars to watch

    def __init__(self, model_dir: str | Path, profile: AcceleratorProfile, *, dtype: str = "bfloat16",
                 num_devices: int = 1, block_size: int = 16, num_blocks: int | None = None,
                 memory_utilization: float = 0.9, swap_space_bytes: float = 2**30, offload_space_bytes: float = 0.0,
                 max_model_len: int | None = None, seed: int = 0, eos_probability: float = 0.0,
                 speculative_config: SpeculativeConfig | None = None, acceptance_rate: float = 0.0,
                 kv_link: LinkProfile = BUILTIN_LINKS["ib"]) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        model_dir = Path(model_dir)
        cfg = ModelConfig.from_dir(model_dir)
        self.model_type, self.eos_token_ids = cfg.model_type, cfg.eos_token_ids
        self.device = f"sim:{profile.name}" + (f"x{num_devices}" if num_devices > 1 else "")
        self.dtype = dtype
        self.geometry = ModelGeometry.from_config(cfg, dtype)
        self.cost = CostModel(self.geometry, profile, num_devices)
        self.block_size = block_size
        self.num_blocks = num_blocks or self.cost.num_kv_blocks(block_size, memory_utilization)
        self.kv_link = kv_link  # what KV loads from other replicas cross (`kv_link_seconds`)
        self.kv_bytes_per_block = block_bytes = block_size * self.geometry.kv_bytes_per_token
        self.num_offload_blocks = int(offload_space_bytes // block_bytes)  # the prefix cache's host tier
        self.num_host_blocks = int(swap_space_bytes // block_bytes) + self.num_offload_blocks
        limit = cfg.rope.max_positions(cfg.max_position_embeddings)
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise ValueError(f"max_model_len {max_model_len} outside (0, {limit}] for this model")
        self.max_model_len = max_model_len or limit
        self.vocab_size = token_vocab_size(model_dir, cfg.vocab_size)
        self.rule = tokens.TokenRule(self.vocab_size, tuple(t for t in cfg.eos_token_ids if t < self.vocab_size),
                                     eos_probability, seed)
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"sim acceptance rate must be in [0, 1], got {acceptance_rate}")
        self.speculation = (speculative_config.num_speculative_tokens, acceptance_rate) if speculative_config else None
        self.last_speculation: dict[str, SpecOutcome] = {}  # the last applied plan's outcomes
        self.requests: dict[str, SimRequest] = {}
        self._prev_sampled: dict[str, int] = {}  # request id -> token, of the last step
        self._failed_ids: set[str] = set()  # failed here; the scheduler has not yet said forget
        self._device_free_at = 0.0  # monotonic end of the last launched step
        self._wall_offset = time.time() - time.monotonic()
        self._lock = threading.Lock()

    def execute(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).wait()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self._failed_ids.clear()
            self._prev_sampled = {}

    # -- KV transfers: no KV is held, so chunks carry no bytes and a load takes the link's time --

    holds_kv = False
    kv_loader = None  # the attach session's `kv_loads.KVLoader`: plans with kv_loads need one

    def read_kv_blocks(self, block_ids: list[int]) -> bytes:
        return b""

    def write_kv_blocks(self, block_ids: list[int], data: bytes) -> None:
        pass

    def kv_link_seconds(self, nbytes: int) -> float:
        """How long a load of `nbytes` crosses the link (`--sim-kv-link`)."""
        return self.kv_link.transfer_seconds(nbytes)

    def launch(self, plan: StepPlan, received: float = 0.0) -> SimPendingStep:
        with self._lock:
            return self._launch(plan, received)

    def _launch(self, plan: StepPlan, received: float) -> SimPendingStep:
        prep_start = time.time()
        loader = kv_loader_for(plan, self.kv_loader, self.num_blocks) if plan.kv_loads else None
        sampled, busy, failed = self.apply(plan)
        if loader is not None:  # in the background, over the simulated link
            loader.start(plan.kv_loads)
        start = max(time.monotonic(), self._device_free_at)
        self._device_free_at = start + busy
        timing = WorkerTiming(received or prep_start, prep_start, start + self._wall_offset)
        return SimPendingStep(plan.step_id, sampled, start + busy, busy, timing, self._wall_offset, failed,
                              self.last_speculation)

    def apply(self, plan: StepPlan) -> tuple[dict[str, int], float, dict[str, str]]:
        """Check and apply a plan, no clock involved: (sampled token per request, device
        seconds, requests that failed alone). The offline simulator drives this on its
        virtual clock. Rows breaking the shared limits fail alone, as on the torch worker.
        """
        if plan.grammars:  # ordered only to a worker whose hello says prepares_grammars
            raise PlanError(f"grammars: this worker prepares none ({STRUCTURED_UNSUPPORTED})")
        for rid in (*plan.finished_ids, *plan.preempted_ids):
            self.requests.pop(rid, None)
            self._failed_ids.discard(rid)
        plan, failed = split_bad_sampling_rows(plan, self.vocab_size, self._failed_ids, max_logprobs=None)
        plan = _refuse_structured(plan, failed, self._failed_ids)
        decodes = self._steady_decodes(plan)
        check_plan(plan if decodes is None else dataclasses.replace(plan, running=RunningDeltas()), self.requests,
                   self._prev_sampled, num_blocks=self.num_blocks, block_size=self.block_size,
                   max_model_len=self.max_model_len)
        for _, host in plan.swap_out:
            self._check_host_block(host)
        for host, _ in plan.swap_in:
            self._check_host_block(host)
        sampled: dict[str, int] = {}
        self.last_speculation = spec = {}
        num_tokens = context = pairs = 0  # the cost model's sums over the batch (`CostModel.step_totals`)
        rows: list[SimRequest] = []  # requests that sample one token (all at once, at the end)
        for state, n in self._register(plan.new_requests):
            state.num_computed += n
            if state.num_computed == len(state.token_ids):
                rows.append(state)
            computed = state.num_computed - n
            num_tokens, context, pairs = num_tokens + n, context + computed + n, pairs + n * computed + n * (n + 1) // 2
        if decodes is not None:  # every running row decodes the token it sampled last step
            states, ends, grown = decodes
            for i in grown:
                states[i].block_ids.extend(plan.running.new_block_ids[i])
            for state, end in zip(states, ends.tolist()):
                state.num_computed = end
            total = int(ends.sum())
            num_tokens, context, pairs = num_tokens + len(states), context + total, pairs + total
            rows += states
        requests, sample_later = self.requests, rows.append
        for r in plan.running if decodes is None else ():  # once per running request per step
            state = requests[r.request_id]
            if r.new_block_ids:
                state.block_ids.extend(r.new_block_ids)
            computed = state.num_computed
            if r.num_draft_tokens:
                k, run = self._speculate(state, r.num_draft_tokens)
                n = 1 + k
                state.num_computed = computed + len(run)
                sampled[r.request_id], spec[r.request_id] = run[-1], SpecOutcome(k, tuple(run[:-1]))
            else:
                n = r.num_scheduled_tokens
                state.num_computed = computed + n
                if computed + n == len(state.token_ids):
                    sample_later(state)
            num_tokens, context, pairs = num_tokens + n, context + computed + n, pairs + n * computed + n * (n + 1) // 2
        if rows:
            self._sample_rows(rows, sampled)
        self._prev_sampled = sampled  # check_plan: a placeholder input must have been sampled last step
        if not (num_tokens or plan.swap_out or plan.swap_in):
            return sampled, 0.0, failed
        step = self.cost.step_totals(num_tokens, context, pairs, len(sampled), len(plan.swap_out) + len(plan.swap_in),
                                     self.block_size)
        return sampled, step.seconds, failed

    def _steady_decodes(self, plan: StepPlan) -> tuple[list[SimRequest], np.ndarray, list[int]] | None:
        """The async loop's steady state, checked column by column instead of row by row:
        when every running row decodes one placeholder token (the one its request sampled in
        the last step), without drafts, within the model length and its blocks, and no id
        repeats: (the rows' states, their lengths after the step, the indices of the rows that
        bring new blocks). None when any row is anything else: `check_plan` then checks each
        row and names what is wrong.

        A request sampled in the last step knows one token more than it has computed (its
        sample, appended by `_sample_rows` or `_speculate`), so its placeholder decode ends at
        `len(token_ids)`: the input is known, as `check_plan` requires."""
        run = plan.running
        ids = run.request_ids
        if not ids or any(run.num_draft_tokens) or not all(run.input_is_placeholder) or \
                min(run.num_scheduled_tokens) != 1 or max(run.num_scheduled_tokens) != 1:
            return None
        unique = set(ids)
        if len(unique) != len(ids) or not (self._prev_sampled.keys() >= unique and self.requests.keys() >= unique) or \
                not unique.isdisjoint([r.request_id for r in plan.new_requests]):
            return None
        states = list(map(self.requests.__getitem__, ids))
        new_blocks = np.asarray(run.num_new_blocks, dtype=np.int64)
        ends = np.fromiter([s.num_computed for s in states], dtype=np.int64, count=len(states)) + 1
        held = np.fromiter(map(len, [s.block_ids for s in states]), dtype=np.int64, count=len(states))
        if ends.max() > self.max_model_len or ((held + new_blocks) * self.block_size < ends).any():
            return None
        grown = np.flatnonzero(new_blocks).tolist()
        for i in grown:
            if not all(0 <= b < self.num_blocks for b in run.new_block_ids[i]):
                return None
        return states, ends, grown

    def _check_host_block(self, block: int) -> None:
        if not 0 <= block < self.num_host_blocks:
            raise PlanError(f"swap: host block {block} outside the host pool [0, {self.num_host_blocks})")

    def _register(self, new: tuple[NewRequest, ...]):
        for r in new:
            num_prompt = len(r.token_ids) if r.num_prompt_tokens is None else r.num_prompt_tokens
            state = SimRequest(r.request_id, list(r.token_ids), r.sampling, list(r.block_ids),
                               r.num_computed_tokens, num_prompt)
            state.history_hash = tokens.extend(tokens.seed_hash(self.rule.seed_of(r.sampling)), state.token_ids)
            self.requests[r.request_id] = state
            yield state, r.num_scheduled_tokens

    def _speculate(self, state: SimRequest, allowed: int) -> tuple[int, list[int]]:
        """(drafts proposed, the run): k drafts, each accepted with the configured chance (a
        deterministic draw), then the bonus; the run is the sim's own next tokens, so the output
        equals a run without speculation."""
        k, rate = (min(allowed, self.speculation[0]), self.speculation[1]) if self.speculation else (0, 0.0)
        run = [self._sample(state)]
        while len(run) <= k and tokens.mix(state.history_hash ^ _ACCEPT_SALT) * 2.0**-64 < rate:
            run.append(self._sample(state))
        return k, run

    def _sample_rows(self, rows: list[SimRequest], sampled: dict[str, int]) -> None:
        """One token for each row, vectorised (`TokenRule.advance_many`), into `sampled`."""
        positions = [len(s.token_ids) for s in rows]
        out, hashes = self.rule.advance_many([s.history_hash for s in rows], positions,
                                             [p - s.num_prompt for p, s in zip(positions, rows)],
                                             [s.sampling for s in rows])
        for state, token, h in zip(rows, out, hashes):
            state.token_ids.append(token)
            state.history_hash = h
            sampled[state.request_id] = token

    def _sample(self, state: SimRequest) -> int:
        ids = state.token_ids
        n = len(ids)
        token = self.rule.next_token(state.history_hash, n, n - state.num_prompt, state.sampling)
        ids.append(token)
        state.history_hash = tokens.extend(state.history_hash, (token,))
        return token


STRUCTURED_UNSUPPORTED = "structured outputs are not supported by the sim worker (--device sim): it has no logits"


def _refuse_structured(plan: StepPlan, failed: dict[str, str], failed_ids: set[str]) -> StepPlan:
    """Take out new requests with a grammar; each fails alone with `STRUCTURED_UNSUPPORTED`."""
    refused = {r.request_id for r in plan.new_requests if r.sampling.structured is not None}
    if not refused:
        return plan
    failed.update(dict.fromkeys(refused, STRUCTURED_UNSUPPORTED))
    failed_ids.update(refused)
    return dataclasses.replace(plan, new_requests=tuple(r for r in plan.new_requests if r.request_id not in refused))


def token_vocab_size(model_dir: Path, config_vocab: int) -> int:
    """Ids the sim may sample: the config's vocabulary, capped by the tokenizer's when present."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return config_vocab
    raw = json.loads(path.read_text())
    ids = list((raw.get("model") or {}).get("vocab", {}).values())
    ids += [t["id"] for t in raw.get("added_tokens") or []]
    return min(config_vocab, max(ids) + 1) if ids else config_vocab
