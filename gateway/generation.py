"""The one code path below both transports: a validated request in, per-choice outputs out.

The gRPC servicer and the HTTP (OpenAI) server both turn their wire format into a
`RawGenerateRequest`, call `Frontend.validate`, then `Frontend.start`, and feed the
scheduler's events to the returned `Generation` until it is done. A `Generation` is one
client request (one prompt of an HTTP completions batch): `n` upstream sequences (ids `<id>` for n == 1, `<id>#<i>` otherwise, seeds
derived from the request's), each with its own `OutputProcessor`. Aborting it aborts all
of them upstream. No grpc and no transport here; events arrive through a sink the caller
chooses (`event_stream.LoopEvents`: an asyncio queue on the transport's event loop).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import structlog
from jinja2 import TemplateError

from gateway.admission import StreamGate
from gateway.metrics import GatewayMetrics
from gateway.output import Output, OutputProcessor
from gateway import reasoning_parsers
from gateway.reasoning_parsers import ReasoningParser
from gateway.scheduler_link import LinkBroken, SchedulerLink
from gateway.tool_parsers import ToolCallParser
from gateway.validation import ModelLimits, RawGenerateRequest, ValidationError, ValidRequest, validate
from stepahead import codec
from stepahead.limits import MAX_ID_CHARS, MAX_START_AFTER_TOKENS
from stepahead.logprobs import Logprobs, PromptLogprobs
from stepahead.plan import FinishReason, WorkerInfo

SEED_MODULUS = 2**64
SCOPE_CHARS = 16  # hex digits of a client's scope in its upstream ids
WAKE = object()  # put into a sink by `Generation.abort` so a waiting consumer sees `done`


class Rejected(Exception):
    """The scheduler refused the request; `code` is its `RejectCode` (scheduler.proto)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SpecUsage:
    """Speculative decoding totals of one sequence (all zero when it never verified drafts)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0  # steps that verified at least one draft

    def __add__(self, other: SpecUsage) -> SpecUsage:
        return SpecUsage(self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                         self.steps + other.steps)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per drafting step: 1 + accepted drafts per step (vLLM's mean acceptance length)."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0


NO_SPEC = SpecUsage()


class ChoiceOutput(NamedTuple):
    """One processed upstream event for choice `index` of a request (a NamedTuple: made once
    per streamed message)."""

    index: int
    output: Output
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""  # with FinishReason.ERROR: what failed
    spec: SpecUsage = NO_SPEC  # speculative decoding totals


def derived_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's own for choice 0, then seed + index (int64 wrap)."""
    if seed is None:
        return None
    value = (seed + index) % SEED_MODULUS
    return value - SEED_MODULUS if value >= 2**63 else value


def scoped_id(client: str, request_id: str) -> str:
    """The id a client's request has upstream: its own id inside the client's scope, so that
    a request id is only ever "already in flight" against the same client's own requests
    (a client that reuses another's fixed id cannot block it). `client` is what tells
    clients apart (its API key, else its connection); only a digest of it goes upstream.
    An id that would pass the id limit with the scope in front goes as its digest."""
    scope = hashlib.blake2b(client.encode(), digest_size=SCOPE_CHARS // 2).hexdigest()
    scoped = f"{scope}.{request_id}"
    if len(scoped) + len("#999") > MAX_ID_CHARS:
        scoped = f"{scope}.{hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()}"
    return scoped


class Generation:
    """One client request in flight (one prompt of it: a completions batch starts one per
    prompt), its n upstream sequences and their output processors."""

    def __init__(self, frontend: Frontend, valid: ValidRequest, request_id: str,
                 sink: Callable[[object], None], transport: str, client: str = "") -> None:
        self.request_id = request_id
        self._sink = sink
        self.valid = valid
        n = valid.n
        base = scoped_id(client, request_id) if client else request_id
        self.upstream_ids = [base] if n == 1 else [f"{base}#{i}" for i in range(n)]
        self._index = {rid: i for i, rid in enumerate(self.upstream_ids)}
        self._processors = [OutputProcessor(frontend.tokenizer, valid) for _ in range(n)]
        self._open = set(self.upstream_ids)  # upstream sequences not finished yet
        self._link = frontend.link
        self._metrics = frontend.metrics
        self._transport = transport
        self._start = time.monotonic()
        self._first_token_seen = False
        self._gate = frontend.gate
        self._released = False
        self._delivered = [0] * n  # token ids handed to the transport, per choice (the usage guard)

    @property
    def done(self) -> bool:
        return not self._open

    def on_event(self, event) -> ChoiceOutput | None:
        """Process one upstream event (or `LinkBroken`); None when the choice already ended."""
        if event is WAKE:
            return None
        if isinstance(event, LinkBroken):
            for rid in self._open:
                self._link.release(rid)
            self._open.clear()
            raise event
        rid = event.request_id
        if rid not in self._open:
            return None  # an event after a stop string ended the choice here
        if event.rejected:
            self._abort_upstream(list(self._open))
            raise Rejected(event.message, event.reject_code)
        index = self._index[rid]
        reason = codec.finish_reason_from_proto(event.finish_reason)
        out = self._processors[index].on_tokens(event.token_ids, reason, *_logprobs_of(event))
        if out.token_ids and not self._first_token_seen:
            self._first_token_seen = True
            self._metrics.observe_first_token(self._transport, time.monotonic() - self._start)
        if out.finished:
            if reason is None:
                self._link.abort(rid)  # a stop string ended it here
            self._close(rid)
            self._metrics.observe_finished(self._transport, out, time.monotonic() - self._start)
        error = event.message if out.finish_reason is FinishReason.ERROR else ""
        spec = SpecUsage(event.num_draft_tokens, event.num_accepted_tokens, event.num_spec_steps) \
            if event.num_spec_steps or event.num_draft_tokens else NO_SPEC
        return ChoiceOutput(index, out, event.num_prompt_tokens, event.num_cached_tokens, error, spec)

    def delivered(self, choice: ChoiceOutput) -> None:
        """Count the token ids of `choice` as handed to the client. The final message's usage
        is the processor's count: if it ever differs from what the stream carried, a message
        was lost or merged away on the way, which is an error to see, never a silent pass."""
        out = choice.output
        self._delivered[choice.index] += len(out.token_ids)
        if out.finished and self._delivered[choice.index] != out.num_output_tokens:
            self._metrics.usage_mismatch.labels(self._transport).inc()
            structlog.get_logger().error("stream_usage_mismatch", request_id=self.request_id, index=choice.index,
                                         usage_completion_tokens=out.num_output_tokens,
                                         delivered_token_ids=self._delivered[choice.index],
                                         transport=self._transport)

    def abort(self, upstream_ids: list[str] | None = None) -> None:
        """End the call: abort every unfinished choice upstream (client gone, or an error; a
        no-op upstream once all finished) and give back the request's slot in the stream
        limit. The transports call it when their last message went out, so a drain
        (`StreamGate.drain`) waits for the final message to be written, not merely computed."""
        if upstream_ids is None and self._open:  # sequences that will never finish
            self._metrics.observe_aborted(self._transport, len(self._open))
        self._abort_upstream(list(self._open) if upstream_ids is None else upstream_ids)
        self._open.clear()
        self._release()
        self._sink(WAKE)

    def _abort_upstream(self, upstream_ids: list[str]) -> None:
        for rid in upstream_ids:
            self._link.abort(rid)
            self._close(rid)

    def _close(self, rid: str) -> None:
        self._open.discard(rid)
        self._link.release(rid)

    def _release(self) -> None:
        """The request's slot in the gateway's stream limit, given back once."""
        if not self._released:
            self._released = True
            self._gate.leave()
            self._metrics.active.dec()


def _logprobs_of(event) -> tuple[tuple[Logprobs, ...], PromptLogprobs | None]:
    """The event's logprobs (one per token, or none) and prompt logprobs, as domain objects."""
    if not (event.logprobs or event.prompt_logprobs):
        return (), None
    lp = tuple(codec.logprobs_from_proto(m) for m in event.logprobs)
    prompt = None
    if event.prompt_logprobs:
        prompt = PromptLogprobs(event.prompt_logprobs_start,
                                tuple(codec.logprobs_from_proto(m) for m in event.prompt_logprobs))
    return lp, prompt


class Frontend:
    """What both transports share: limits, tokenizer, the scheduler link, metrics."""

    def __init__(self, tokenizer, model: WorkerInfo, link: SchedulerLink,
                 max_request_bytes: int, metrics: GatewayMetrics, gate: StreamGate | None = None,
                 stream_interval: int = 1, tool_call_parser: ToolCallParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser  # how `tool_choice: auto` output is read (None: refused)
        self.reasoning_parser = reasoning_parser
        self._think_ids = _think_ids(tokenizer) if reasoning_parser is not None else None
        self.stream_interval = stream_interval  # tokens per streamed message at most (event_stream.py)
        self.model = model
        self.limits = ModelLimits(model.model_name, model.max_model_len, model.vocab_size, max_request_bytes,
                                  model.max_logprobs)
        self.link = link
        self.metrics = metrics
        self.gate = gate or StreamGate(1 << 30)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None, *,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of a conversation (and its tools), rendered with the model's chat template
        (`continue_final_message` and `template_kwargs` checked by `validation.chat_options`).

        Same ids as the tokenizer's `apply_chat_template(..., tools=tools, tokenize=True)`: the
        rendered text already holds the template's special tokens, so none are added.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError("messages", "this model has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools,
                continue_final_message=continue_final_message, **(template_kwargs or {}))
        except TemplateError as exc:
            raise ValidationError("messages", f"the chat template rejected the conversation: {exc}") from None
        except ValueError as exc:  # transformers': continue_final_message, and the final message is not in the text
            if not continue_final_message:
                raise
            raise ValidationError("continue_final_message", f"the chat template cannot continue it: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def validate(self, raw: RawGenerateRequest) -> ValidRequest:
        valid = validate(raw, self.limits, self.tokenize, self.render_chat)
        self._check_capabilities(valid)
        structured = valid.sampling.structured
        if raw.chat_messages is not None and self._think_ids is not None and structured is not None:
            # with a reasoning parser the constraint is the answer's: it starts after `</think>`
            gated = reasoning_parsers.after_reasoning(structured, valid.prompt_token_ids, *self._think_ids)
            valid = dataclasses.replace(valid, sampling=dataclasses.replace(valid.sampling, structured=gated))
        return valid

    def _check_capabilities(self, valid: ValidRequest) -> None:
        """What the attached workers announced they cannot do (the sim worker: no logits)."""
        s = valid.sampling
        if not self.model.logprobs and (s.logprobs is not None or s.prompt_logprobs is not None):
            raise ValidationError("logprobs", f"this server's workers ({self.model.device}) compute no logprobs")
        if not self.model.structured_outputs and s.structured is not None:
            raise ValidationError("structured_outputs", f"this server's workers ({self.model.device}) do not "
                                  "support structured outputs")

    def start(self, valid: ValidRequest, request_id: str, sink: Callable[[object], None],
              transport: str, client: str = "") -> Generation:
        """Submit every choice of `valid`; raises ValueError when the id is already in flight
        for the same `client` (see `scoped_id`; "" = no scope: the id as it is),
        `admission.Overloaded` past the stream limit, `admission.Draining` while draining."""
        try:
            self.gate.enter()
        except Exception as exc:
            self.metrics.observe_rejected(transport, type(exc).__name__.lower())
            raise
        self.metrics.active.inc()
        gen = Generation(self, valid, request_id, sink, transport, client)
        submitted = 0
        try:
            for index, rid in enumerate(gen.upstream_ids):
                sampling = dataclasses.replace(valid.sampling, seed=derived_seed(valid.sampling.seed, index))
                self.link.submit(codec.submit_to_proto(rid, valid.prompt_token_ids, sampling, valid.priority), sink)
                submitted += 1
        except ValueError:
            gen.abort(gen.upstream_ids[:submitted])  # never another request's id
            raise
        self.metrics.observe_started(transport, len(valid.prompt_token_ids))
        return gen


def _think_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of `<think>` and `</think>` (one added token each in Qwen3's and
    DeepSeek-R1's tokenizers); refused at startup when the end marker is too long to gate on."""
    open_ids, close_ids = (tuple(tokenizer.encode(tag, add_special_tokens=False))
                           for tag in (reasoning_parsers.OPEN, reasoning_parsers.CLOSE))
    if not 0 < len(close_ids) <= MAX_START_AFTER_TOKENS:
        raise ValueError(f"--reasoning-parser: {reasoning_parsers.CLOSE!r} is {len(close_ids)} tokens for this "
                         f"tokenizer; structured outputs can start after at most {MAX_START_AFTER_TOKENS}")
    return open_ids, close_ids
