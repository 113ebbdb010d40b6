"""Structured outputs on the worker: xgrammar grammars, one matcher per request, the token mask.

Only the worker imports xgrammar (it imports torch and transformers); the gateway and the
scheduler check what pure Python can (`stepahead.limits.check_structured`).

- `GrammarCache` compiles a `StructuredOutput` into an xgrammar `CompiledGrammar`, once per
  distinct constraint, with an LRU bound (`--structured-outputs-cache-size`). xgrammar and
  the tokenizer are loaded on first use, so a worker that never sees a grammar never pays.
- `RequestGrammar` is a request's `GrammarMatcher`. It is advanced only on tokens the
  request really holds: `advance(output)` accepts the output tokens it has not seen yet,
  so a request resumed after preemption (recompute or swap: it comes back as a new
  request with prompt + committed output) rebuilds its state from the committed output.
- `GrammarMasks.apply(logits, reqs, settle)` masks the rows of requests with a grammar:
  it first makes sure every such request's last token is on the host (`settle()` waits
  for the previous step's sampled ids when one of them is still a placeholder — the
  current step's forward is already queued on the device, so the wait and the mask build
  overlap it), advances the matchers, fills a host bitmask, uploads it without a host
  wait and applies it on the device. Never an all-allowed mask: a row whose matcher cannot
  go on raises, and its request fails alone. The one exception is a gated constraint
  (`StructuredOutput.start_after`, a reasoning model's `</think>`): its rows allow every
  token until the request's output holds that token sequence (`Gate`), then the grammar
  applies from its start.

Speculative decoding: `cut_drafts` keeps the longest prefix of a request's n-gram drafts
its grammar allows (`accept_token` over them, then `rollback`; none once the grammar ended); `apply(..., drafts)` fills
one mask row per verified position (row j: the matcher after the output and d_1..d_j),
then rolls the drafts back. The matcher advances over the tokens really emitted only, at
the next step (`advance` reads the token list, where the resolved run is written).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from stepahead import limits
from stepahead.plan import GrammarPrep, GrammarReady, SamplingParams, StructuredKind, StructuredOutput
from worker_service.streams import host_to_device

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (LRU)


_XGRAMMAR_SOURCE = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # "[19:17:46] /project/cpp/x.cc:820: "


def _reason(exc: Exception) -> str:
    """What a client reads of xgrammar's error: its message without the time and the C++ source
    line it puts in front, one line, bounded."""
    return _XGRAMMAR_SOURCE.sub("", str(exc).strip()).replace("\n", " ")[:300]


class GrammarError(ValueError):
    """The constraint does not compile: the request itself is invalid (INVALID_ARGUMENT)."""


class GrammarViolation(RuntimeError):
    """A request's tokens left its grammar, or its grammar ended without the request ending."""


class CompileObserver(Protocol):
    def on_grammar_cache_hit(self) -> None: ...
    def on_grammar_cache_miss(self) -> None: ...
    def on_grammar_compiled(self, seconds: float) -> None: ...


class _NoObserver:
    def on_grammar_cache_hit(self) -> None:
        pass

    def on_grammar_cache_miss(self) -> None:
        pass

    def on_grammar_compiled(self, seconds: float) -> None:
        pass


class GrammarCache:
    """StructuredOutput → xgrammar CompiledGrammar, LRU-bounded; xgrammar loaded lazily.

    `get` compiles on the caller's thread (the step's) when the grammar is not there yet;
    `prepare` compiles on a background thread instead (a plan's `grammars`), and a `get` of a
    grammar being prepared waits for that compile rather than starting its own."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 capacity: int = DEFAULT_CACHE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"structured outputs cache size must be >= 1, got {capacity}")
        self.model_dir, self.vocab_size, self.eos_token_ids = Path(model_dir), vocab_size, eos_token_ids
        self.capacity = capacity
        self.observer: CompileObserver = _NoObserver()
        self._lock = threading.Lock()  # the two maps below
        self._load_lock = threading.Lock()  # the compiler's creation (seconds: not under `_lock`)
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._pending: dict[StructuredOutput, concurrent.futures.Future] = {}  # being prepared
        self._compiler = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None  # `prepare`'s thread, on first use

    def get(self, structured: StructuredOutput):
        """The compiled grammar (raises GrammarError when xgrammar refuses the constraint)."""
        with self._lock:
            compiled = self._compiled.get(structured)
            if compiled is not None:
                self._compiled.move_to_end(structured)
                self.observer.on_grammar_cache_hit()
                return compiled
            pending = self._pending.get(structured)
        if pending is not None:
            return pending.result()
        self.observer.on_grammar_cache_miss()
        return self._compile(structured)

    def prepare(self, structured: StructuredOutput, check: Callable[[], object] = lambda: None
                ) -> concurrent.futures.Future:
        """The grammar compiled on a background thread, after `check()` there (which may raise):
        a future of it (done at once when it is in the cache; its exception a GrammarError when
        xgrammar refuses the constraint, or what `check` raised)."""
        with self._lock:
            compiled = self._compiled.get(structured)
            if compiled is not None:
                self._compiled.move_to_end(structured)
                self.observer.on_grammar_cache_hit()
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(compiled)
                return done
            pending = self._pending.get(structured)
            if pending is not None:
                return pending
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
            self.observer.on_grammar_cache_miss()
            future = self._pending[structured] = self._executor.submit(self._checked_compile, structured, check)
        future.add_done_callback(lambda _: self._forget_pending(structured))
        return future

    def _forget_pending(self, structured: StructuredOutput) -> None:
        with self._lock:
            self._pending.pop(structured, None)

    def _checked_compile(self, structured: StructuredOutput, check: Callable[[], object]):
        check()
        return self._compile(structured)

    def _compile(self, structured: StructuredOutput):
        compiler = self._load()
        start = time.perf_counter()
        try:
            compiled = _COMPILE[structured.kind](compiler, structured)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors for a bad constraint
            field = f"structured_outputs.{structured.kind.value}"
            raise GrammarError(f"{field}: does not compile: {_reason(exc)}") from None
        self.observer.on_grammar_compiled(time.perf_counter() - start)
        with self._lock:
            self._compiled[structured] = compiled
            if len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def _load(self):
        with self._load_lock:
            if self._compiler is None:
                import xgrammar  # noqa: PLC0415 (lazy: imports transformers, takes a second)

                info = tokenizer_info(self.model_dir, self.vocab_size, self.eos_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def tokenizer_info(model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """xgrammar's view of the model's vocabulary, read from the `tokenizer.json` the gateway
    tokenizes with (wrapped as the transformers fast tokenizer xgrammar reads). Only a
    directory without one goes through `AutoTokenizer.from_pretrained`, which builds the same
    from the directory's files at several times the cost. The first grammar compiled waits for
    this load (on the compile thread when it was prepared: docs/structured-outputs.md)."""
    import xgrammar  # noqa: PLC0415 (lazy: imports transformers, takes a second)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: PLC0415 (xgrammar imported it)

    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer  # noqa: PLC0415

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)))
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


def _json_schema(compiler, s: StructuredOutput):
    # compact JSON (no free whitespace): a weak model cannot loop on blanks forever
    return compiler.compile_json_schema(s.spec, any_whitespace=False)


def _json_object(compiler, s: StructuredOutput):
    return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)


def _regex(compiler, s: StructuredOutput):
    return compiler.compile_regex(s.spec)


def _choice(compiler, s: StructuredOutput):
    # EBNF string literals take JSON's escapes
    return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in s.choices))


def _grammar(compiler, s: StructuredOutput):
    return compiler.compile_grammar(s.spec)


_COMPILE = {
    StructuredKind.JSON_SCHEMA: _json_schema,
    StructuredKind.JSON_OBJECT: _json_object,
    StructuredKind.REGEX: _regex,
    StructuredKind.CHOICE: _choice,
    StructuredKind.GRAMMAR: _grammar,
}


class Gate:
    """Free output until the token sequence `after` has been generated (then the grammar
    applies); open from the start when `after` is empty."""

    def __init__(self, after: tuple[int, ...] = ()) -> None:
        self.after = tuple(after)
        self.open = not self.after
        self._tail: tuple[int, ...] = ()  # the last len(after) - 1 tokens seen while closed

    def feed(self, token: int) -> None:
        tail = (*self._tail, token)[-len(self.after):]
        if tail == self.after:
            self.open = True
        self._tail = tail[1:] if len(tail) == len(self.after) else tail

    def free_prefix(self, tokens: list[int]) -> int | None:
        """How many leading `tokens` come before the grammar applies (0 when open; i + 1 when
        tokens[i] completes the sequence; None when the gate stays closed over all of them).
        The gate's state is unchanged."""
        if self.open:
            return 0
        tail = self._tail
        for i, token in enumerate(tokens):
            tail = (*tail, token)[-len(self.after):]
            if tail == self.after:
                return i + 1
        return None


ALL_ALLOWED = -1  # a bitmask word with every bit set (int32)


class RequestGrammar:
    """One request's matcher (behind its gate), advanced only over tokens the request holds."""

    def __init__(self, compiled, start_after: tuple[int, ...] = ()) -> None:
        import xgrammar  # noqa: PLC0415 (already loaded by the cache)

        self.matcher = xgrammar.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar 0.2
        self.gate = Gate(start_after)
        self.num_accepted = 0  # output tokens consumed: by the gate while closed, then by the matcher

    @property
    def ended(self) -> bool:
        """The grammar accepted its stop token (EOS): the request's structured output is complete."""
        return self.gate.open and self.matcher.is_terminated()

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Accept the output tokens not accepted yet, `token_ids[num_prompt_tokens + num_accepted:]`
        (every id known on the host, none a placeholder); only the new ones are read.

        The grammar's end is a stop: once the matcher accepted EOS, the tokens after it are
        never fed to it. Under async scheduling the steps planned before the scheduler saw that
        EOS sample on (masked to EOS by `fill`), and a speculative run may hold a bonus token
        after an accepted EOS draft; the scheduler drops them all, since EOS ends a structured
        request (`stepahead.limits` refuses ignore_eos and min_tokens with structured outputs).
        """
        for token in token_ids[num_prompt_tokens + self.num_accepted:]:
            if not self.gate.open:
                self.gate.feed(token)
                self.num_accepted += 1
                continue
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(token):
                raise GrammarViolation(f"token {token} (output position {self.num_accepted}) breaks the grammar")
            self.num_accepted += 1

    def allowed_prefix(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar accepts after the consumed output (state
        unchanged); those before the gate opens are all accepted."""
        free = self.gate.free_prefix(drafts)
        if free is None:
            return len(drafts)
        n = 0
        for token in drafts[free:]:
            if not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return free + n

    def fill_rows(self, bitmask: torch.Tensor, row: int, drafts: list[int], eos_token_ids: tuple[int, ...]) -> None:
        """Rows row .. row + len(drafts) of bitmask: row + j is what may follow the output and
        drafts[:j] (every token while the gate is closed there; drafts were cut with
        `allowed_prefix`). The matcher is left as it was."""
        free = self.gate.free_prefix(drafts)
        accepted = 0
        for j in range(len(drafts) + 1):
            if free is None or j < free:
                bitmask[row + j] = ALL_ALLOWED
                continue
            if j > free:
                if not self.matcher.accept_token(drafts[j - 1]):
                    raise GrammarViolation(f"draft {drafts[j - 1]} breaks the grammar (drafts are cut before)")
                accepted += 1
            self.fill(bitmask, row + j, eos_token_ids)
        if accepted:
            self.matcher.rollback(accepted)  # the matcher advances over emitted tokens only

    def fill(self, bitmask: torch.Tensor, row: int, eos_token_ids: tuple[int, ...]) -> None:
        """bitmask: [rows, words] int32 on the host; writes row `row` (the gate open).

        A grammar that has ended (its EOS was sampled) allows only EOS: under async scheduling
        the step after the EOS was planned before the scheduler saw it, and the scheduler
        drops that step's token for the finished request anyway.
        """
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
            return
        words = [0] * bitmask.shape[1]
        for t in eos_token_ids:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class GrammarMasks:
    """The runner's structured-output state: matchers of live requests and the per-step mask."""

    def __init__(self, cache: GrammarCache, device: torch.device) -> None:
        self.cache = cache
        self.device = device
        self._requests: dict[str, RequestGrammar] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, words] int32 host buffer, grown on demand
        self.last_build_s = 0.0  # host seconds the last mask took to build (wait excluded)
        self.last_wait_s = 0.0  # host seconds the last mask waited for the previous step's ids

    def __len__(self) -> int:
        return len(self._requests)

    def register(self, request_id: str, structured: StructuredOutput) -> None:
        """Compile (or find) the grammar and start a fresh matcher; GrammarError if it does not
        compile. One compiled grammar serves a constraint with and without a gate."""
        compiled = self.cache.get(dataclasses.replace(structured, start_after=()))
        self._requests[request_id] = RequestGrammar(compiled, structured.start_after)

    def prepare(self, grammars: Sequence[GrammarPrep], vocab_size: int,
                report: Callable[[GrammarReady], None] | None) -> None:
        """A plan's `grammars`, compiled on the cache's background thread; each reported once,
        as soon as it is compiled or refused (`report` None: compiled only, e.g. on a
        tensor-parallel rank other than 0). A constraint that breaks the shared limits is
        refused, as its registration would refuse it (checked on the background thread too)."""
        for prep in grammars:
            check = functools.partial(limits.check_structured, SamplingParams(max_tokens=1, structured=prep.structured),
                                      vocab_size, meta_schema=False)
            future = self.cache.prepare(dataclasses.replace(prep.structured, start_after=()), check)
            if report is not None:
                future.add_done_callback(functools.partial(_report_ready, report, prep.request_id))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        self._requests.clear()

    def cut_drafts(self, req, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` that `req`'s grammar allows after its output (every
        id of `req.token_ids` known on the host); all of them for a request without one."""
        grammar = self._requests.get(req.request_id)
        if grammar is None or not drafts:
            return drafts
        grammar.advance(req.token_ids, req.num_prompt_tokens)
        if grammar.ended:  # nothing is drafted (or verified) past the grammar's end
            return []
        return drafts[: grammar.allowed_prefix(drafts)]

    def apply(self, logits: torch.Tensor, reqs, settle, drafts: list[list[int]] | None = None) -> torch.Tensor:
        """logits [rows, vocab] → logits with disallowed tokens at -inf on grammar rows (a new
        tensor; `logits` itself when no row has a grammar). `reqs`: the n CachedRequests;
        `settle()` puts every placeholder's sampled id into its request's token_ids.
        `drafts` (a speculative step): request i has 1 + len(drafts[i]) consecutive rows, row j
        masked by the grammar after its output and drafts[i][:j] (drafts the grammar allows:
        `cut_drafts`); without, one row per request."""
        if not self._requests:  # the common case: no live request has a grammar
            return logits
        grammar_reqs = [i for i, r in enumerate(reqs) if r.request_id in self._requests]
        if not grammar_reqs:
            return logits
        ks = [len(d) for d in drafts] if drafts is not None else [0] * len(reqs)
        first = list(itertools.accumulate([k + 1 for k in ks], initial=0))  # each request's first row
        start = time.perf_counter()
        if any(reqs[i].token_ids[-1] < 0 for i in grammar_reqs):
            settle()  # waits for the previous step's ids; this step's forward is already queued
        built = time.perf_counter()
        rows = [first[i] + j for i in grammar_reqs for j in range(ks[i] + 1)]  # [m] masked rows
        bitmask = self._host_bitmask(len(rows), logits.shape[1])
        m = 0
        for i in grammar_reqs:
            r = reqs[i]
            grammar = self._requests[r.request_id]
            grammar.advance(r.token_ids, r.num_prompt_tokens)
            grammar.fill_rows(bitmask, m, drafts[i] if ks[i] else [], self.cache.eos_token_ids)
            m += ks[i] + 1
        allowed = unpack_bitmask(host_to_device(bitmask[: len(rows)], torch.int32, logits.device),
                                 logits.shape[1])  # [m, vocab] bool
        index = host_to_device(rows, torch.int64, logits.device)  # [m]
        masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))  # [m, vocab]
        self.last_wait_s, self.last_build_s = built - start, time.perf_counter() - built
        return logits.index_put((index,), masked)

    def _host_bitmask(self, rows: int, vocab: int) -> torch.Tensor:
        words = -(-vocab // 32)
        if self._bitmask is None or self._bitmask.shape[0] < rows or self._bitmask.shape[1] != words:
            self._bitmask = torch.zeros(max(rows, 8), words, dtype=torch.int32)
        return self._bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [m, words] int32 (bit j of word w: token 32w + j allowed) → [m, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32], made on the device
    bits = (bitmask[:, :, None] >> shifts) & 1  # [m, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def _report_ready(report: Callable[[GrammarReady], None], request_id: str, future: concurrent.futures.Future) -> None:
    """A prepared grammar's end as its `GrammarReady`."""
    exc = future.exception()
    if exc is None:
        report(GrammarReady(request_id))
    elif isinstance(exc, GrammarError):
        report(GrammarReady(request_id, str(exc), invalid=True))
    elif isinstance(exc, limits.LimitError):
        report(GrammarReady(request_id, f"invalid sampling row: {exc}", invalid=True))
    elif isinstance(exc, ImportError):  # a server problem, not the request's
        report(GrammarReady(request_id, f"structured outputs need xgrammar on the worker: {exc}"))
    else:
        report(GrammarReady(request_id, f"the grammar did not compile: {exc!r}"[:1000]))


def split_bad_grammars(plan, masks: GrammarMasks, failed_ids: set[str], failed: dict[str, str]):
    """Register the grammars of `plan`'s new requests; take out those that fail.

    Returns (the plan that runs, ids of requests whose constraint does not compile). Failures
    are added to `failed` (id → reason) and `failed_ids`; one bad grammar never fails its step.
    """
    keep, invalid = [], []
    for r in plan.new_requests:
        if r.sampling.structured is None:
            keep.append(r)
            continue
        try:
            masks.register(r.request_id, r.sampling.structured)
            keep.append(r)
        except GrammarError as exc:
            failed[r.request_id] = str(exc)
            invalid.append(r.request_id)
        except ImportError as exc:  # a server problem, not the request's: an error finish
            failed[r.request_id] = f"structured outputs need xgrammar on the worker: {exc}"
    if len(keep) == len(plan.new_requests):
        return plan, ()
    failed_ids.update(r.request_id for r in plan.new_requests if r.request_id in failed)
    return dataclasses.replace(plan, new_requests=tuple(keep)), tuple(invalid)
