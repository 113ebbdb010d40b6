"""Structured outputs on the random-weight built-in `tiny` model: the real scheduler core and
the real ModelRunner in one process (xgrammar on the worker side).

The oracle for "the output follows the constraint" is independent of xgrammar: `jsonschema`
for JSON schemas, Python's `re.fullmatch` for regexes, set membership for choices. Async
scheduling is checked against the synchronous loop token for token, with the next step
launched before the previous step's ids were read (the worker's placeholder path).
"""

from __future__ import annotations

import collections
import json
import queue
import re
import threading

import jsonschema
import torch

from scheduler_service.core.config import PreemptionMode, SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import FinishReason
from stepahead.plan import GrammarPrep, GrammarReady, SamplingParams, StepPlan, StructuredKind, StructuredOutput
from tests.fixtures_models import smollm2_model_dir, tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.integration.local_engine import LocalEngine
from worker_service import grammar
from worker_service.grammar import GrammarCache, tokenizer_info
from worker_service.model_runner import ModelRunner
from testing.structured import SCHEMA

BLOCK = 16

JSON_SCHEMA = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
SMALL_SCHEMA = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 30},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["kind", "age", "tags"], "additionalProperties": False}))
REGEX = StructuredOutput(StructuredKind.REGEX, r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)")
CHOICE = StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no", "it depends"))


def sampled(structured: StructuredOutput, seed: int, max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured=structured)


class LaunchAheadEngine(LocalEngine):
    """Launches every planned step at once (step t+1 before step t's ids were read), as the
    worker daemon does, so a grammar row's previous token is still a placeholder."""

    def __init__(self, runner, config) -> None:
        super().__init__(runner, config)
        self.launched: collections.deque = collections.deque()
        self.settled_by_mask = 0

    def plan_ahead(self) -> None:
        before = len(self.plans)
        super().plan_ahead()
        for plan in self.plans[before:]:
            self.launched.append(self.runner.launch(plan))

    def check_failures(self, result) -> None:
        # a row whose grammar ended (EOS sampled, the next step already planned) is masked to
        # EOS, not failed: a failure would push the whole step onto the row-by-row path
        assert not set(result.failed) - set(result.invalid_ids), result.failed

    def commit_oldest(self):
        result = self.launched.popleft().wait()
        self.check_failures(result)
        _, events = self.loop.commit(result)
        self.scheduler.check_integrity()
        self._record(events)
        return events


def make_engine(model_dir, *, async_on=True, launch_ahead=False, num_blocks=1024, **overrides) -> LocalEngine:
    """The daemons' setup: grammars prepared beside the steps unless `prepare_grammars=False`
    (a worker that predates it: each compiles in its request's first step)."""
    runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=num_blocks, num_host_blocks=256)
    config = SchedulerConfig(num_gpu_blocks=num_blocks, num_cpu_blocks=256, max_model_len=runner.max_model_len,
                             block_size=BLOCK, max_num_batched_tokens=1024, async_scheduling=async_on,
                             eos_token_ids=runner.eos_token_ids, **{"prepare_grammars": True, **overrides})
    return (LaunchAheadEngine if launch_ahead else LocalEngine)(runner, config)


def run(engine: LocalEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> LocalEngine:
    for rid, (prompt, sampling) in requests.items():
        engine.add(Request(rid, prompt, sampling))
    engine.run()
    engine.assert_no_leaks()
    return engine


def prompt(tokenizer, i: int) -> list[int]:
    return tokenizer.encode(f"Describe pet number {i} as JSON:")


def text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_fifty_json_schema_requests_parse_and_validate(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    engine = run(make_engine(tiny_model_dir, launch_ahead=True),
                 {f"j{i}": (prompt(tiny_tokenizer, i), sampled(JSON_SCHEMA, seed=i)) for i in range(50)})
    docs = []
    for i in range(50):
        assert engine.finish[f"j{i}"] is FinishReason.STOP, engine.outputs[f"j{i}"]
        doc = json.loads(text(tiny_tokenizer, engine.outputs[f"j{i}"]))
        jsonschema.validate(doc, SCHEMA)
        docs.append(doc)
    assert len({json.dumps(d) for d in docs}) > 25  # really sampled, not one forced path
    # one compile for fifty requests; matchers only for requests the worker still holds (the
    # last finished ones are forgotten with the next plan's finished_ids)
    assert len(engine.runner.grammar.cache) == 1
    assert len(engine.runner.grammar) == len(engine.runner.requests) < 50


def test_regex_and_choice_outputs_match_next_to_free_text(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    requests = {f"re{i}": (prompt(tiny_tokenizer, i), sampled(REGEX, seed=i)) for i in range(8)}
    requests |= {f"ch{i}": (prompt(tiny_tokenizer, i), sampled(CHOICE, seed=100 + i)) for i in range(8)}
    requests["free"] = (prompt(tiny_tokenizer, 99), free)
    engine = run(make_engine(tiny_model_dir, launch_ahead=True), requests)
    for i in range(8):
        assert re.fullmatch(REGEX.spec, text(tiny_tokenizer, engine.outputs[f"re{i}"]))
        assert text(tiny_tokenizer, engine.outputs[f"ch{i}"]) in CHOICE.choices
        assert engine.finish[f"ch{i}"] is FinishReason.STOP
    assert len({text(tiny_tokenizer, engine.outputs[f"ch{i}"]) for i in range(8)}) > 1
    alone = run(make_engine(tiny_model_dir), {"free": requests["free"]})
    assert engine.outputs["free"] == alone.outputs["free"]  # grammar rows leave other rows alone


def test_async_equals_sync_token_for_token_with_preemption(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    requests = {f"j{i}": (prompt(tiny_tokenizer, i), sampled(SMALL_SCHEMA, seed=i, max_tokens=48)) for i in range(4)}
    requests |= {f"re{i}": (prompt(tiny_tokenizer, i), sampled(REGEX, seed=i, max_tokens=48)) for i in range(2)}
    sync = run(make_engine(tiny_model_dir, async_on=False), requests)
    for mode in (PreemptionMode.RECOMPUTE, PreemptionMode.SWAP):
        asyn = run(make_engine(tiny_model_dir, async_on=True, launch_ahead=True, num_blocks=8, preemption_mode=mode),
                   requests)
        assert asyn.outputs == sync.outputs, mode  # seeded draws: neither async nor preemption changes a token
        assert asyn.scheduler.stats().num_preemptions > 0, mode
        assert any(r.input_is_placeholder for p in asyn.plans for r in p.running)
    for i in range(4):
        jsonschema.validate(json.loads(text(tiny_tokenizer, sync.outputs[f"j{i}"])), json.loads(SMALL_SCHEMA.spec))


BAD_GRAMMARS = {
    "lookahead": StructuredOutput(StructuredKind.REGEX, "(?=a)b"),  # Python's re accepts it
    "ebnf": StructuredOutput(StructuredKind.GRAMMAR, "root ::= undefined_rule"),
}


def test_a_grammar_the_worker_cannot_compile_fails_alone_as_invalid(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    """A worker that compiles in the request's first step (no `prepares_grammars`)."""
    bad = BAD_GRAMMARS
    requests = {rid: (prompt(tiny_tokenizer, 0), sampled(s, seed=1)) for rid, s in bad.items()}
    requests["good"] = (prompt(tiny_tokenizer, 1), sampled(CHOICE, seed=3))
    engine = make_engine(tiny_model_dir, prepare_grammars=False)
    for rid, (ids, sampling) in requests.items():
        engine.add(Request(rid, ids, sampling))
    engine.plan_ahead()
    plan = engine.loop.oldest
    result = engine.runner.execute(plan)
    assert set(result.invalid_ids) == set(bad) <= result.failed.keys()
    for rid in bad:
        assert result.failed[rid].startswith(f"structured_outputs.{bad[rid].kind.value}: does not compile: ")
        reason = result.failed[rid].split(": does not compile: ")[1]
        assert ".cc:" not in reason and "\n" not in reason, reason  # xgrammar's message, not its C++ source line
    assert "undefined_rule" in result.failed["ebnf"]
    _, events = engine.loop.commit(result)
    assert {e.request_id for e in events if e.rejected} == set(bad)
    for e in events:
        engine.outputs[e.request_id] += e.new_token_ids
    engine.run()
    engine.assert_no_leaks()
    assert text(tiny_tokenizer, engine.outputs["good"]) in CHOICE.choices


def test_a_prepared_grammar_the_worker_cannot_compile_fails_its_request_alone_as_invalid(
        tiny_model_dir, tiny_tokenizer):  # noqa: F811
    """Grammars prepared beside the steps: the refusals come as the worker's reports, before
    the requests ever run; the good request beside them runs to its end."""
    engine = make_engine(tiny_model_dir)
    for rid, s in BAD_GRAMMARS.items():
        engine.add(Request(rid, prompt(tiny_tokenizer, 0), sampled(s, seed=1)))
    engine.add(Request("good", prompt(tiny_tokenizer, 1), sampled(CHOICE, seed=3)))
    refused = []
    while len(refused) < len(BAD_GRAMMARS):
        engine.plan_ahead()
        if engine.pending:
            engine.commit_oldest()  # the worker runs the plan that orders the grammars
        ready = engine.grammar_reports.get(timeout=60)
        event = engine.scheduler.grammar_ready(ready)
        engine.scheduler.check_integrity()
        if event is not None:
            refused.append(event)
    by_id = {e.request_id: e for e in refused}
    assert by_id.keys() == BAD_GRAMMARS.keys()
    assert all(e.rejected and e.finish_reason is FinishReason.ERROR for e in refused)
    for rid, s in BAD_GRAMMARS.items():
        assert f"structured_outputs.{s.kind.value}: does not compile: " in by_id[rid].message
    assert not any(r.request_id in by_id for p in engine.plans for r in p.new_requests)  # never ran
    engine.run()
    engine.assert_no_leaks()
    assert text(tiny_tokenizer, engine.outputs["good"]) in CHOICE.choices


class CountingObserver(collections.Counter):
    """The grammar cache's hits, misses and compiles (`GrammarCache.observer`), counted."""

    def on_grammar_cache_hit(self):
        self["hit"] += 1

    def on_grammar_cache_miss(self):
        self["miss"] += 1

    def on_grammar_compiled(self, seconds):
        assert seconds >= 0.0
        self["compiled"] += 1


def test_a_plan_ordering_a_grammar_past_the_limits_gets_it_refused_as_invalid(tiny_model_dir):  # noqa: F811
    """The worker checks what it is asked to prepare (a scheduler that skipped the check)."""
    runner = ModelRunner(tiny_model_dir, block_size=BLOCK, num_blocks=64)
    reports = queue.SimpleQueue()
    runner.grammar_report = reports.put
    not_json = StructuredOutput(StructuredKind.JSON_SCHEMA, "{not json")
    runner.execute(StepPlan(0, grammars=(GrammarPrep("r", not_json),)))
    assert reports.get(timeout=60) == GrammarReady(  # from the compile thread
        "r", "invalid sampling row: structured_outputs.json: is not valid JSON: Expecting property name enclosed in "
             "double quotes: line 1 column 2 (char 1)", invalid=True)
    assert reports.empty()


def test_no_step_waits_for_a_grammar_being_prepared(tiny_model_dir, tiny_tokenizer, monkeypatch):  # noqa: F811
    """The defect: a request's grammar compiled inside the step that admitted it, so every
    stream in that step waited for the compile (and for xgrammar's load, on the first one).
    Now the compile runs on the worker's background thread: with it held, a plain request
    beside the structured one runs to its end, the structured one is not sent to the worker
    before the report, and its registration then finds the grammar compiled."""
    release = threading.Event()
    compile_choice = grammar._COMPILE[StructuredKind.CHOICE]

    def held(compiler, structured):
        assert release.wait(60), "the test never released the compile"
        return compile_choice(compiler, structured)

    monkeypatch.setitem(grammar._COMPILE, StructuredKind.CHOICE, held)
    engine = make_engine(tiny_model_dir)
    counts = engine.runner.grammar.cache.observer = CountingObserver()
    engine.add(Request("choice", prompt(tiny_tokenizer, 0), sampled(CHOICE, seed=3)))
    engine.add(Request("plain", prompt(tiny_tokenizer, 1), SamplingParams(temperature=0.0, max_tokens=8,
                                                                          ignore_eos=True)))
    while "plain" not in engine.finish:
        engine.step()
    assert len(engine.outputs["plain"]) == 8
    assert [g.request_id for p in engine.plans for g in p.grammars] == ["choice"]
    assert not any(r.request_id == "choice" for p in engine.plans for r in p.new_requests)
    assert engine.scheduler.num_preparing == 1 and counts == {"miss": 1}
    release.set()
    engine.run()
    engine.assert_no_leaks()
    assert text(tiny_tokenizer, engine.outputs["choice"]) in CHOICE.choices
    assert counts == {"miss": 1, "compiled": 1, "hit": 1}  # prepared once, found at registration


def test_compiled_grammars_are_an_lru_cache_with_hit_and_miss_counts(tiny_model_dir):  # noqa: F811
    cache = GrammarCache(tiny_model_dir, 4096, (2,), capacity=2)
    seen = cache.observer = CountingObserver()
    a, b, c = (StructuredOutput(StructuredKind.CHOICE, choices=(x,)) for x in "abc")
    first = cache.get(a)
    assert cache.get(a) is first
    cache.get(b)
    cache.get(c)  # evicts a (least recently used)
    assert len(cache) == 2
    assert cache.get(a) is not first
    assert seen == {"hit": 1, "miss": 4, "compiled": 4}


def test_the_grammar_vocabulary_from_tokenizer_json_is_the_one_auto_tokenizer_gives(
        tiny_model_dir, smollm2_model_dir):  # noqa: F811
    """The worker builds xgrammar's vocabulary from `tokenizer.json` (a second faster than
    `AutoTokenizer.from_pretrained`); the oracle is xgrammar's own reading of the
    AutoTokenizer, as the worker did before: same token strings, vocabulary type, prefix space,
    stop and special ids, on both built-in tokenizers."""
    import xgrammar
    from transformers import AutoTokenizer

    for model_dir, eos in ((tiny_model_dir, (2,)), (smollm2_model_dir, (2,))):
        vocab_size = len(AutoTokenizer.from_pretrained(model_dir))
        fast = tokenizer_info(model_dir, vocab_size, eos)
        oracle = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir),
                                                         vocab_size=vocab_size, stop_token_ids=list(eos))
        assert (fast.vocab_type, fast.add_prefix_space, fast.vocab_size) == \
            (oracle.vocab_type, oracle.add_prefix_space, oracle.vocab_size)
        assert fast.decoded_vocab == oracle.decoded_vocab
        assert (fast.stop_token_ids, sorted(fast.special_token_ids)) == \
            (oracle.stop_token_ids, sorted(oracle.special_token_ids))


def spec_engine(model_dir, k: int, async_on: bool = True, launch_ahead: bool = False) -> LocalEngine:
    from stepahead.speculative import SpeculativeConfig

    runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=256, num_host_blocks=0,
                         speculative_config=SpeculativeConfig(k, 1, 3) if k else None)
    config = SchedulerConfig(num_gpu_blocks=256, num_cpu_blocks=0, max_model_len=runner.max_model_len,
                             block_size=BLOCK, max_num_batched_tokens=256, async_scheduling=async_on,
                             eos_token_ids=runner.eos_token_ids, num_speculative_tokens=k)
    return (LaunchAheadEngine if launch_ahead else LocalEngine)(runner, config)


def test_structured_requests_speculate_and_still_follow_their_grammar(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    """Structured requests get drafts (cut where the grammar refuses them) verified under one
    grammar mask per position: greedy output equals the run without speculation token for
    token (sync, and async with each step launched before the previous one's ids were read),
    sampled output still validates, free text beside them is unchanged."""
    example = tiny_tokenizer.encode('Example: {"kind":"cat","age":3,"tags":["a","b"]} it depends yes@abc.com Now:')
    greedy_json = SamplingParams(temperature=0.0, max_tokens=60, structured=SMALL_SCHEMA)
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = {"js": (example, greedy_json), "js2": (example + example[:5], greedy_json),
                "ch": (example, SamplingParams(temperature=0.0, max_tokens=20, structured=CHOICE)),
                "re": (example, sampled(REGEX, seed=5, max_tokens=40)),
                "sj": (example, sampled(SMALL_SCHEMA, seed=9, max_tokens=60)),
                "f1": (prompt(tiny_tokenizer, 2) * 3, free)}
    plain = run(spec_engine(tiny_model_dir, 0), requests)
    for async_on in (False, True):
        spec = spec_engine(tiny_model_dir, 4, async_on, launch_ahead=async_on)
        for rid, (ids, sampling) in requests.items():
            spec.add(Request(rid, ids, sampling))
        runs = collections.Counter()  # steps that committed accepted drafts, per request
        while spec.scheduler.has_unfinished_requests() or spec.pending:
            for event in spec.step():
                runs[event.request_id] += len(event.new_token_ids) > 1
        spec.assert_no_leaks()
        for rid in ("js", "js2", "ch", "f1"):
            assert spec.outputs[rid] == plain.outputs[rid], rid
        for rid in ("js", "js2", "sj"):
            jsonschema.validate(json.loads(text(tiny_tokenizer, spec.outputs[rid])), json.loads(SMALL_SCHEMA.spec))
        assert text(tiny_tokenizer, spec.outputs["ch"]) in CHOICE.choices
        assert re.fullmatch(REGEX.spec, text(tiny_tokenizer, spec.outputs["re"]))
        assert runs["js"] and runs["js2"], "no accepted drafts of a greedy JSON request: a weak test"


def test_drafts_are_cut_at_the_grammar_and_masked_per_position(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    """`cut_drafts` keeps the allowed prefix and leaves the matcher as it was; verified row j's
    mask equals the plain one-row mask of the request holding drafts d_1..d_j."""
    from worker_service.grammar import GrammarMasks
    from worker_service.input_batch import CachedRequest

    masks = GrammarMasks(GrammarCache(tiny_model_dir, len(tiny_tokenizer), (tiny_tokenizer.eos_token_id,)),
                         torch.device("cpu"))
    vocab = len(tiny_tokenizer)
    prompt_ids = tiny_tokenizer.encode("Answer:")
    good = tiny_tokenizer.encode("it depends", add_special_tokens=False)
    drafts = good + tiny_tokenizer.encode("xyz", add_special_tokens=False)
    sampling = SamplingParams(temperature=0.0, max_tokens=20, structured=CHOICE)
    req = CachedRequest("r", list(prompt_ids), sampling, [], 0, len(prompt_ids))
    masks.register("r", CHOICE)
    cut = masks.cut_drafts(req, drafts)
    assert cut == good
    assert masks.cut_drafts(req, drafts) == good  # the matcher was rolled back
    logits = torch.zeros(1 + len(cut), vocab)
    verified = masks.apply(logits, [req], lambda: None, [cut])  # [1 + k, vocab]
    for j in range(len(cut) + 1):
        other = GrammarMasks(masks.cache, torch.device("cpu"))
        other.register("r", CHOICE)
        held = CachedRequest("r", prompt_ids + cut[:j], sampling, [], 0, len(prompt_ids))
        plain = other.apply(torch.zeros(1, vocab), [held], lambda: None)
        assert torch.equal(torch.isfinite(verified[j]), torch.isfinite(plain[0])), j
        assert 0 < int(torch.isfinite(verified[j]).sum()) < vocab  # never an all-allowed mask
        if j < len(cut):
            assert torch.isfinite(verified[j, cut[j]])
