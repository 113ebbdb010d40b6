"""The step plan: the one domain object the scheduler emits and the worker executes.

Pure Python (no torch, no grpc). The scheduler builds a `StepPlan` per step; the worker's
`ModelRunner.execute(plan)` runs it and answers with a `StepResult`. Plans are *diffs*:
a request is sent in full once (`NewRequest`), then only as `RunningRequest` deltas until
it is finished or preempted. Plans are executed strictly in `step_id` order.

Worker-side semantics (the contract both sides rely on):
- Order inside one plan: forget `finished_ids` and `preempted_ids`; run `swap_out`
  (device → host) then `swap_in` (host → device) copies; register `new_requests`;
  apply `running` deltas; run one forward over all scheduled tokens; sample.
- A request's known tokens are `NewRequest.token_ids` plus every token the worker sampled
  for it since. A step computes tokens `[num_computed, num_computed + num_scheduled)` of
  that sequence; a decode whose input is the token sampled by the previous, still
  unreported step has `input_is_placeholder=True` and the worker reads it from the
  sampled-token tensor it kept on the device.
- A request samples one token in a step iff, after the step, `num_computed` reaches the
  number of tokens the worker knows for it (i.e. the step covers its last known token).
  Partial prefill chunks sample nothing.
- Until a request has `min_tokens` outputs, its EOS ids (unless `ignore_eos`) and its
  `stop_token_ids` are masked out of the logits, so they cannot be sampled (vLLM semantics).
- A request whose sampling row fails the shared limits (`stepahead.limits`), or whose
  sampling still fails, fails alone: it is listed in `StepResult.failed` with a reason,
  samples nothing and is forgotten; later deltas for it (planned before the scheduler
  saw the failure) are skipped. The rest of the step runs as if it had not been there.
- A request with `SamplingParams.structured` samples only tokens its grammar allows (the
  worker compiles the grammar once per request, advances it on the request's committed
  tokens, and masks the logits after bias/penalties, before temperature and truncation).
  A grammar the worker cannot compile fails its request alone and is listed in
  `StepResult.invalid_ids` as well as `failed` (the client gets INVALID_ARGUMENT / 400).
- Grammars prepared beside the steps (a worker whose hello says `prepares_grammars`): a
  plan's `grammars` order the worker to compile each request's grammar in the background
  (the plan's forward, and later ones, run meanwhile) and to report each once, as soon as it
  is compiled or refused, with a `GrammarReady` on its attach stream (rank 0 of a
  tensor-parallel group alone reports). The scheduler holds such a request back until that
  report and only then sends it as a `NewRequest`, so no step waits for a compile: its
  registration finds the grammar compiled (a worker compiles it then if its cache dropped
  it meanwhile). A refused grammar fails the request as an invalid one.
- Seeded sampling: the random draw for a request depends only on (seed, number of tokens
  the request holds when sampling), never on batch composition, preemption or timing.
- Tensor-parallel groups (`WorkerInfo.group_id`): every rank receives the same plans and
  applies them identically; rank 0 samples and broadcasts the ids inside the step, and only
  rank 0 sends `StepResult`s (the other ranks send none).
- Disaggregated prefill/decode (docs/disaggregation.md): a plan's `kv_loads` order the
  worker to copy blocks of a finished prefill from another replica's worker (`source`, its
  `WorkerHello.kv_transfer_address`) into its own `dst_block_ids`. The worker starts each
  load after the plan's swaps, in the background (the plan's forward, and later ones, run
  meanwhile: no plan touches a block being loaded), and reports it once, as soon as it
  ends, with a `KVLoaded` on its attach stream (not in a `StepResult`): written, or the
  error (source unreachable, timeout, a reply that does not fit). The scheduler keeps the
  source blocks fenced on the source replica and the destination blocks out of every plan
  until that report; the request then resumes as a `NewRequest` whose
  `num_computed_tokens` covers the loaded prompt.
- Speculative decoding (docs/speculative-decoding.md): a decode delta with
  `num_draft_tokens = k > 0` allows the worker to propose up to k draft tokens (n-gram
  lookup over every token it knows for the request) and verify them in the same forward;
  `num_scheduled_tokens = 1 + k` is the scheduler's worst case (budget, KV blocks, length
  limits): the worker computes 1 + (drafts proposed) tokens. Its input may be a
  placeholder whose position depends on the previous step's acceptance: the worker
  resolves the previous step's tokens before launching a step that needs them. The result
  lists, per speculating request, the drafts proposed and the accepted ones
  (`StepResult.speculation`); the request's new tokens are the accepted drafts followed by
  its `sampled_token_ids` entry (the bonus token, or the replacement of the first rejected
  draft). Greedy rows accept the longest prefix equal to the target argmax; sampled rows
  use rejection sampling (accept draft d with probability p_target(d); on rejection sample
  from p_target with d removed, renormalised), so the output distribution is the target's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from stepahead.logprobs import MAX_LOGPROBS, Logprobs, PromptLogprobs


class FinishReason(enum.Enum):
    """Why a request (or one of its `n` sequences) ended: one type for scheduler and gateway.

    The values are the OpenAI API's `finish_reason` strings.
    """

    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the request failed on the server


class StructuredKind(enum.Enum):
    """What a `StructuredOutput.spec` holds (vLLM's `structured_outputs` / OpenAI's `response_format`)."""

    JSON_SCHEMA = "json"  # spec: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec is empty
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # spec: an EBNF grammar (xgrammar's dialect, root rule `root`)


class WorkerRole(enum.Enum):
    """What a replica does in a disaggregated deployment (`stepahead worker --role`)."""

    BOTH = "both"  # prefill and decode (the default: no disaggregation)
    PREFILL = "prefill"  # new prompts; after the first token the KV moves to a decode replica
    DECODE = "decode"  # continues requests prefilled elsewhere (new prompts only when no replica prefills)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output; hashable: the worker caches compiled grammars by it."""

    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()
    # The constraint applies only once the output holds this token sequence (a reasoning
    # model's `</think>`): before it the output is free, the tokens of the sequence included.
    # Empty: from the first output token.
    start_after: tuple[int, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated by the gateway before they get here."""

    temperature: float = 1.0  # 0.0 means greedy (argmax)
    top_k: int = -1  # -1 (or 0) disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus sampling
    min_p: float = 0.0  # 0.0 disables min-p
    seed: int | None = None  # per-request seed; None draws from the worker's generator
    max_tokens: int = 16  # output tokens at most (checked by the scheduler)
    min_tokens: int = 0  # EOS / stop tokens are ignored before this many outputs
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that finish the request
    ignore_eos: bool = False  # keep generating past the model's EOS ids
    # Applied on the worker to the raw logits, in this order, before temperature/truncation
    # (vLLM's scopes): logit_bias; repetition over prompt + output tokens (HF/CTRL rule:
    # positive logits divided, negative multiplied); frequency (times the count) and
    # presence (once) over output tokens only.
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct
    repetition_penalty: float = 1.0  # 1 disables; > 1 discourages repeats
    presence_penalty: float = 0.0  # 0 disables
    frequency_penalty: float = 0.0  # 0 disables
    structured: StructuredOutput | None = None  # constrain the output to a grammar (None: free text)
    # Raw logprobs (`stepahead.logprobs`): None = none; 0 = the sampled token's; k = also the top k.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Needs the per-request token counts the worker keeps on the device."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class NewRequest:
    """A request the worker does not know yet (first schedule, or resumed after preemption)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt, plus committed output for a resumed request
    sampling: SamplingParams
    block_ids: tuple[int, ...]  # device KV blocks, in sequence order
    num_computed_tokens: int  # tokens whose KV is already in block_ids (prefix hit / swap-in)
    num_scheduled_tokens: int  # tokens to compute this step, from num_computed_tokens on
    num_prompt_tokens: int | None = None  # the prompt's share of token_ids (None: all of them)


class RunningRequest(NamedTuple):
    """A delta for a request the worker already holds.

    Built per request per step on both sides (the scheduler's plan, the worker's decode), so a
    named tuple rather than a frozen dataclass: as immutable, but built at C speed in bulk
    (`stepahead.codec` makes a step's deltas with `tuple.__new__` over zipped columns) and
    ~5x cheaper to build one by one than a frozen dataclass's `__init__`.
    """

    request_id: str
    new_block_ids: tuple[int, ...]  # appended to the request's block table
    num_scheduled_tokens: int  # tokens to compute this step (1 for a decode)
    input_is_placeholder: bool = False  # decode input is a token not yet reported back
    num_draft_tokens: int = 0  # speculative decode: drafts the worker may propose and verify (<= K)


# A RunningRequest from one (request_id, new_block_ids, num_scheduled_tokens, input_is_placeholder,
# num_draft_tokens) tuple, all five given: no Python-level __new__ (the per-request hot path).
running_request = partial(tuple.__new__, RunningRequest)


class RunningDeltas(Sequence):
    """A plan's running deltas as columns, as the scheduler builds them in bulk and the wire
    carries them (`StepPlan.running` holds one; given `RunningRequest`s, it makes one). Read
    one by one, each is a `RunningRequest`; a column is indexed like the deltas."""

    __slots__ = ("request_ids", "new_block_ids", "num_scheduled_tokens", "input_is_placeholder", "num_draft_tokens",
                 "_num_new_blocks")

    def __init__(self, request_ids: Sequence[str] = (), new_block_ids: Sequence[tuple[int, ...]] = (),
                 num_scheduled_tokens: Sequence[int] = (), input_is_placeholder: Sequence[bool] = (),
                 num_draft_tokens: Sequence[int] = (), num_new_blocks: Sequence[int] | None = None) -> None:
        """`num_new_blocks`: len() of each `new_block_ids` entry, when the builder knows them."""
        self.request_ids, self.new_block_ids = request_ids, new_block_ids
        self.num_scheduled_tokens, self.input_is_placeholder = num_scheduled_tokens, input_is_placeholder
        self.num_draft_tokens, self._num_new_blocks = num_draft_tokens, num_new_blocks

    @property
    def num_new_blocks(self) -> Sequence[int]:
        if self._num_new_blocks is None:
            self._num_new_blocks = list(map(len, self.new_block_ids))
        return self._num_new_blocks

    @classmethod
    def of(cls, deltas: Sequence[RunningRequest]) -> RunningDeltas:
        if isinstance(deltas, RunningDeltas):
            return deltas
        return cls(*map(tuple, zip(*deltas))) if deltas else cls()

    def followed_by(self, other: RunningDeltas) -> RunningDeltas:
        """These deltas, then `other`'s, as one set of columns."""
        columns = (list(mine) + list(theirs) for mine, theirs in zip(self.columns(), other.columns()))
        return RunningDeltas(*columns, list(self.num_new_blocks) + list(other.num_new_blocks))

    def columns(self) -> tuple[Sequence, ...]:
        return (self.request_ids, self.new_block_ids, self.num_scheduled_tokens, self.input_is_placeholder,
                self.num_draft_tokens)

    def __len__(self) -> int:
        return len(self.request_ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        return running_request(tuple(column[index] for column in self.columns()))

    def __iter__(self):
        return map(running_request, zip(*self.columns()))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RunningDeltas({tuple(self)!r})"


@dataclass(frozen=True)
class KVLoad:
    """Blocks to copy from another replica's worker into this one's (see the module doc)."""

    transfer_id: int  # the scheduler's id of the transfer, echoed in `KVLoaded`
    source: str  # host:port of the source worker's KV transfer service
    src_block_ids: tuple[int, ...]  # device blocks on the source, in sequence order
    dst_block_ids: tuple[int, ...]  # this worker's device blocks, one per source block
    source_instance: str = ""  # the source's `WorkerInfo.kv_transfer_instance`: no other serves it


@dataclass(frozen=True)
class KVLoaded:
    """A worker's report that a `KVLoad` ended (sent once per transfer, on the attach stream)."""

    transfer_id: int
    error: str = ""  # empty: every block was written; otherwise why not (the blocks hold garbage)


@dataclass(frozen=True)
class GrammarPrep:
    """A grammar to compile in the background for a request a later plan sends (module doc)."""

    request_id: str
    structured: StructuredOutput


@dataclass(frozen=True)
class GrammarReady:
    """A worker's report that a `GrammarPrep` is done (sent once per request, on the attach stream)."""

    request_id: str
    error: str = ""  # empty: compiled; otherwise why the request cannot run
    invalid: bool = False  # with an error: the constraint itself does not compile (the client's fault)


@dataclass(frozen=True)
class StepPlan:
    """One step for the worker. `step_id` increases by one per plan."""

    step_id: int
    new_requests: tuple[NewRequest, ...] = ()
    running: RunningDeltas = RunningDeltas()  # given as RunningRequests, kept as columns
    finished_ids: tuple[str, ...] = ()  # finished or aborted since the last plan: forget
    preempted_ids: tuple[str, ...] = ()  # preempted (recompute or swap): forget
    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block) copies
    swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block) copies
    kv_loads: tuple[KVLoad, ...] = ()  # blocks to load from other replicas, in the background
    grammars: tuple[GrammarPrep, ...] = ()  # grammars to compile in the background

    def __post_init__(self) -> None:
        object.__setattr__(self, "running", RunningDeltas.of(self.running))

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(self.running.num_scheduled_tokens)

    @property
    def num_requests(self) -> int:
        return len(self.new_requests) + len(self.running)

    @property
    def is_empty(self) -> bool:
        return self.num_requests == 0 and not (self.swap_out or self.swap_in or self.kv_loads or self.grammars)


@dataclass(frozen=True)
class WorkerTiming:
    """One step as the worker saw it (wall-clock seconds, 0 when unknown; `device_busy_s` is a duration)."""

    plan_received: float = 0.0
    prep_start: float = 0.0
    forward_start: float = 0.0
    forward_end: float = 0.0  # the step's sampled ids are on the host
    result_sent: float = 0.0
    device_busy_s: float = 0.0  # seconds the device computed this step (0: unknown); not a timestamp


@dataclass(frozen=True)
class SpecOutcome:
    """One speculating request's verification in a step."""

    num_draft_tokens: int  # drafts the worker proposed (<= the plan's num_draft_tokens)
    accepted_token_ids: tuple[int, ...] = ()  # the accepted drafts, in order (a prefix of the proposal)
    # with sampling.logprobs: each accepted draft's raw logprobs, in order (the sampled token's
    # are in StepResult.logprobs); empty otherwise
    accepted_logprobs: tuple[Logprobs, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What the worker answers for one plan."""

    step_id: int
    # request id -> token, in the order the worker sampled them (off the wire: a lazily read
    # `columns.SampledTokens`)
    sampled_token_ids: Mapping[str, int] = field(default_factory=dict)
    timing: WorkerTiming = field(default_factory=WorkerTiming)
    # request id -> reason: requests that failed alone on the worker (bad sampling row,
    # sampling error); they sampled nothing and the worker forgot them.
    failed: dict[str, str] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)  # request id -> its sampled token's
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # request id -> this chunk's
    # request id -> outcome, for requests that were allowed drafts; their committed tokens
    # this step are the accepted drafts followed by the sampled token.
    speculation: dict[str, SpecOutcome] = field(default_factory=dict)
    # Of `failed`: the requests that are themselves invalid (a grammar that does not compile);
    # the client gets INVALID_ARGUMENT / HTTP 400 rather than a server error.
    invalid_ids: tuple[str, ...] = ()

    def new_token_ids(self, request_id: str) -> tuple[int, ...]:
        """The tokens a request produced in this step (accepted drafts + sampled token)."""
        outcome = self.speculation.get(request_id)
        last = (self.sampled_token_ids[request_id],)
        return outcome.accepted_token_ids + last if outcome else last


@dataclass(frozen=True)
class WorkerInfo:
    """What an attached worker serves: its hello on the attach stream."""

    worker_id: str
    model_name: str
    model_type: str
    dtype: str
    device: str
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: the largest logprobs / prompt_logprobs k served
    group_id: str = ""  # the tensor-parallel group this worker is a rank of ("" = a replica alone)
    tp_rank: int = 0  # rank in the group; rank 0 alone reports results
    tp_size: int = 1  # the group's size k
    logprobs: bool = True  # computes logprobs (the sim worker does not: it has no logits)
    structured_outputs: bool = True  # constrains output to a grammar (the sim worker does not)
    prepares_grammars: bool = False  # compiles a plan's `grammars` in the background (module doc)
    # the window every attention layer applies (0: some layer sees the whole context): the
    # scheduler frees the leading blocks all layers slid past (`KVCacheManager.release_slid`)
    sliding_window: int = 0
    # host blocks --kv-offloading-size added (0: no host tier): the scheduler keeps evicted
    # prefix-cache blocks in the host pool and loads them back on a hit (`KVCacheManager`)
    num_offload_blocks: int = 0
    role: WorkerRole = WorkerRole.BOTH  # --role: prefill, decode or both (disaggregation)
    # host:port of this worker's KV transfer service, where decode replicas read the blocks
    # of prompts it prefilled ("" : none; a prefill-role worker always has one)
    kv_transfer_address: str = ""
    # a random id its KVTransfer service drew at start: a restarted worker at the same address
    # is another instance, and refuses reads meant for the one that held the blocks
    kv_transfer_instance: str = ""
