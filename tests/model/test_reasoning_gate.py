"""Structured outputs that start after the reasoning ends (`StructuredOutput.start_after`,
issue 32): the output is free until it holds the gate's token sequence (a reasoning model's
`</think>`), then follows the grammar; `max_tokens` counts both parts.

The matcher gate itself (`worker_service.grammar`), then the real scheduler core and the real
ModelRunner on the random-weight `tiny` model: its reasoning is whatever it samples (a logit
bias on the gate's tokens makes it close the block within a few dozen tokens), and the
answer after the gate validates against the schema (jsonschema, independent of xgrammar).
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import FinishReason
from stepahead import limits
from stepahead.plan import SamplingParams
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.model.test_structured_outputs import CHOICE, SMALL_SCHEMA, make_engine, spec_engine, text
from worker_service.grammar import Gate, GrammarCache, GrammarMasks, GrammarViolation
from worker_service.input_batch import CachedRequest

END = "</think>"


def gate_ids(tokenizer) -> tuple[int, ...]:
    """The marker's first two tokens: a multi-token gate (a sequence, not one id) that a
    random-weight model biased towards both closes within a few dozen tokens."""
    ids = tuple(tokenizer.encode(END, add_special_tokens=False))[:2]
    assert len(ids) == 2
    return ids


def first_after(ids: list[int], gate: tuple[int, ...]) -> int | None:
    """The output position right after the first occurrence of `gate` (None: never)."""
    for i in range(len(ids) - len(gate) + 1):
        if tuple(ids[i:i + len(gate)]) == gate:
            return i + len(gate)
    return None


def test_the_gate_opens_on_the_whole_sequence_only():
    gate = Gate((5, 6, 7))
    for token in (5, 6, 5, 6, 8, 7):  # prefixes, a restart, a broken run
        gate.feed(token)
        assert not gate.open
    assert gate.free_prefix([5, 6, 7, 1]) == 3
    assert gate.free_prefix([6, 7]) is None and not gate.open  # state unchanged by looking ahead
    for token in (5, 5, 6):
        gate.feed(token)
    assert gate.free_prefix([7]) == 1
    gate.feed(7)
    assert gate.open and gate.free_prefix([1, 2]) == 0
    assert Gate().open


def masks_for(model_dir, tokenizer) -> GrammarMasks:
    return GrammarMasks(GrammarCache(model_dir, len(tokenizer), (tokenizer.eos_token_id,)), torch.device("cpu"))


def allowed(masks: GrammarMasks, req: CachedRequest, vocab: int, drafts=None) -> torch.Tensor:
    rows = 1 + (len(drafts[0]) if drafts else 0)
    return torch.isfinite(masks.apply(torch.zeros(rows, vocab), [req], lambda: None, drafts))  # [rows, vocab]


def test_the_matcher_accepts_anything_until_the_gate_then_enforces(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    vocab = len(tiny_tokenizer)
    gate = gate_ids(tiny_tokenizer)
    gated = dataclasses.replace(CHOICE, start_after=gate)
    prompt_ids = tiny_tokenizer.encode("Answer:")
    thought = tiny_tokenizer.encode("no JSON here {{ ]] maybe", add_special_tokens=False)
    sampling = SamplingParams(temperature=0.0, max_tokens=60, structured=gated)
    masks = masks_for(tiny_model_dir, tiny_tokenizer)
    masks.register("r", gated)
    assert len(masks.cache) == 1  # compiled once, as the ungated constraint

    free = CachedRequest("r", prompt_ids + thought + list(gate[:-1]), sampling, [], 0, len(prompt_ids))
    assert bool(allowed(masks, free, vocab).all())  # free: tokens the grammar would refuse were accepted
    plain = masks_for(tiny_model_dir, tiny_tokenizer)
    plain.register("p", CHOICE)
    fresh = allowed(plain, CachedRequest("p", list(prompt_ids), sampling, [], 0, len(prompt_ids)), vocab)
    assert 0 < int(fresh.sum()) < vocab

    opened = CachedRequest("r", free.token_ids + [gate[-1]], sampling, [], 0, len(prompt_ids))
    assert torch.equal(allowed(masks, opened, vocab), fresh)  # the grammar from its start
    answer = tiny_tokenizer.encode("it depends", add_special_tokens=False)
    done = CachedRequest("r", opened.token_ids + answer + [tiny_tokenizer.eos_token_id], sampling, [], 0,
                         len(prompt_ids))
    masks.apply(torch.zeros(1, vocab), [done], lambda: None)
    assert masks._requests["r"].ended
    bad = masks_for(tiny_model_dir, tiny_tokenizer)
    bad.register("b", gated)
    broken = CachedRequest("b", opened.token_ids + thought, sampling, [], 0, len(prompt_ids))
    with pytest.raises(GrammarViolation):  # after the gate the grammar holds
        bad.apply(torch.zeros(1, vocab), [broken], lambda: None)


def test_drafts_across_the_gate_are_free_before_it_and_masked_after(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    vocab = len(tiny_tokenizer)
    gate = gate_ids(tiny_tokenizer)
    gated = dataclasses.replace(CHOICE, start_after=gate)
    prompt_ids = tiny_tokenizer.encode("Answer:")
    sampling = SamplingParams(temperature=0.0, max_tokens=60, structured=gated)
    thought = tiny_tokenizer.encode("hmm", add_special_tokens=False)
    good = tiny_tokenizer.encode("yes", add_special_tokens=False)
    drafts = thought + list(gate) + good + tiny_tokenizer.encode("xyz", add_special_tokens=False)
    masks = masks_for(tiny_model_dir, tiny_tokenizer)
    masks.register("r", gated)
    req = CachedRequest("r", list(prompt_ids), sampling, [], 0, len(prompt_ids))
    cut = masks.cut_drafts(req, drafts)
    assert cut == thought + list(gate) + good  # cut where the grammar, not the reasoning, refuses
    rows = allowed(masks, req, vocab, [cut])
    free = len(thought) + len(gate)
    for j in range(len(cut) + 1):
        other = masks_for(tiny_model_dir, tiny_tokenizer)
        other.register("r", gated)
        held = CachedRequest("r", prompt_ids + cut[:j], sampling, [], 0, len(prompt_ids))
        assert torch.equal(rows[j], allowed(other, held, vocab)[0]), j
        assert bool(rows[j].all()) == (j < free), j
    assert masks.cut_drafts(req, drafts) == cut  # the matcher and the gate were left as they were


def gated_requests(tokenizer, n: int, max_tokens: int = 120) -> dict[str, tuple[list[int], SamplingParams]]:
    gate = gate_ids(tokenizer)
    structured = dataclasses.replace(SMALL_SCHEMA, start_after=gate)
    bias = tuple((t, 8.0) for t in sorted(set(gate)))  # the block closes within a few dozen tokens
    return {f"r{i}": (tokenizer.encode(f"Think, then describe pet {i} as JSON:"),
                      SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured=structured,
                                     logit_bias=bias)) for i in range(n)}


def check_gated(engine, tokenizer, requests) -> list[list[int]]:
    """Every request that closed its reasoning has an answer that validates; the reasoning parts."""
    gate = gate_ids(tokenizer)
    schema = json.loads(SMALL_SCHEMA.spec)
    thoughts = []
    for rid in requests:
        out = engine.outputs[rid]
        start = first_after(out, gate)
        assert start is not None, (rid, text(tokenizer, out))
        assert engine.finish[rid] is FinishReason.STOP, (rid, text(tokenizer, out))
        jsonschema.validate(json.loads(text(tokenizer, out[start:])), schema)
        thoughts.append(out[:start - len(gate)])
    return thoughts


@pytest.mark.parametrize("k", [0, 3], ids=["plain", "ngram"])
def test_reasoning_is_free_and_the_answer_after_it_validates(tiny_model_dir, tiny_tokenizer, k):  # noqa: F811
    requests = gated_requests(tiny_tokenizer, 12)
    engine = make_engine(tiny_model_dir, launch_ahead=True) if not k else spec_engine(tiny_model_dir, k, True, True)
    for rid, (ids, sampling) in requests.items():
        engine.add(Request(rid, ids, sampling))
    engine.run()
    engine.assert_no_leaks()
    thoughts = check_gated(engine, tiny_tokenizer, requests)
    free = [t for t in thoughts if t]
    assert len(free) > len(thoughts) // 2  # most did reason before answering
    for t in free:  # the reasoning is not held to the schema's grammar
        with pytest.raises(ValueError):
            json.loads(text(tiny_tokenizer, t))


def test_max_tokens_counts_the_reasoning_and_the_answer(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    gate = gate_ids(tiny_tokenizer)
    requests = gated_requests(tiny_tokenizer, 8, max_tokens=24)
    engine = make_engine(tiny_model_dir, launch_ahead=True)
    for rid, (ids, sampling) in requests.items():
        engine.add(Request(rid, ids, sampling))
    engine.run()
    engine.assert_no_leaks()
    cut = [rid for rid in requests if engine.finish[rid] is FinishReason.LENGTH]
    assert cut  # a weak test otherwise
    for rid in requests:
        assert len(engine.outputs[rid]) <= 24
    for rid in cut:
        assert len(engine.outputs[rid]) == 24
    assert any(first_after(engine.outputs[rid], gate) not in (None, 0) for rid in cut)  # reasoning, then cut


def test_the_gate_is_bounded_by_the_shared_limits():
    vocab = 100
    base = SamplingParams(structured=dataclasses.replace(CHOICE, start_after=(1, 2)))
    assert limits.check_sampling(base, vocab).structured.start_after == (1, 2)
    for gate in ((100,), tuple(range(limits.MAX_START_AFTER_TOKENS + 1))):
        bad = dataclasses.replace(base, structured=dataclasses.replace(CHOICE, start_after=gate))
        with pytest.raises(limits.LimitError) as exc:
            limits.check_sampling(bad, vocab)
        assert exc.value.field == "structured_outputs.start_after_token_ids"
