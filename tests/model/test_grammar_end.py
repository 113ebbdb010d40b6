"""A grammar's end is a stop (issue 36): once a structured request's matcher accepted EOS, the
steps the scheduler planned before it saw that EOS (async scheduling, pipelined launches) and
a speculative run's bonus token after an accepted EOS draft never reach the matcher; no draft
is proposed past the end. Such a request completes with its valid output and nothing is
reported (or logged) as failed, with and without n-gram speculation.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import FinishReason
from stepahead.plan import SamplingParams
from stepahead.speculative import SpeculativeConfig
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.model.test_structured_outputs import BLOCK, CHOICE, SMALL_SCHEMA, LaunchAheadEngine, text
from worker_service.grammar import GrammarCache, GrammarMasks
from worker_service.input_batch import CachedRequest
from worker_service.model_runner import ModelRunner

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4)


class RecordingEngine(LaunchAheadEngine):
    """LaunchAheadEngine that records every failure a step reports instead of asserting."""

    def __init__(self, runner, config) -> None:
        super().__init__(runner, config)
        self.failed: dict[str, str] = {}

    def check_failures(self, result) -> None:
        self.failed.update(result.failed)


def pipelined_engine(model_dir, spec: SpeculativeConfig | None) -> RecordingEngine:
    """Three plans in flight (the adaptive window's depth), each launched at once: the two
    steps after the one that samples EOS are planned and launched before its result is read."""
    runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=256, speculative_config=spec)
    config = SchedulerConfig(num_gpu_blocks=256, num_cpu_blocks=0, max_model_len=runner.max_model_len,
                             block_size=BLOCK, max_num_batched_tokens=256, async_scheduling=True,
                             max_concurrent_batches=3, eos_token_ids=runner.eos_token_ids,
                             num_speculative_tokens=spec.num_speculative_tokens if spec else 0)
    return RecordingEngine(runner, config)


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_structured_requests_end_at_their_grammar_without_failing(tiny_model_dir, tiny_tokenizer, spec,  # noqa: F811
                                                                  capfd):
    # the example twice: the n-gram proposer finds drafts in it
    example = '{"kind":"cat","age":3,"tags":["a","b"]}'
    ids = tiny_tokenizer.encode(f"Example: {example} {example} Now:")
    engine = pipelined_engine(tiny_model_dir, spec)
    requests = {f"r{i}": SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i, max_tokens=60,
                                        structured=SMALL_SCHEMA) for i in range(4)}
    for rid, sampling in requests.items():
        engine.add(Request(rid, ids, sampling))
    engine.run()
    engine.assert_no_leaks()
    assert engine.failed == {}
    for rid in requests:
        assert engine.finish[rid] is FinishReason.STOP, (rid, text(tiny_tokenizer, engine.outputs[rid]))
        assert engine.outputs[rid][-1] in engine.runner.eos_token_ids
        jsonschema.validate(json.loads(text(tiny_tokenizer, engine.outputs[rid])), json.loads(SMALL_SCHEMA.spec))
    # steps ran past each grammar's end: the case this test is about
    assert sum(r.input_is_placeholder for p in engine.plans for r in p.running) > 0
    assert "terminated" not in capfd.readouterr().err  # xgrammar's warning: a token fed after the end


def test_tokens_after_the_grammar_end_are_not_fed_and_nothing_is_drafted(tiny_model_dir, tiny_tokenizer):  # noqa: F811
    """A run that holds tokens after the accepted EOS (a bonus token after an EOS draft, a
    planned-ahead step's token) leaves the matcher at its end; drafts are cut to none and
    the mask allows EOS only."""
    eos = (tiny_tokenizer.eos_token_id,)
    masks = GrammarMasks(GrammarCache(tiny_model_dir, len(tiny_tokenizer), eos), torch.device("cpu"))
    prompt_ids = tiny_tokenizer.encode("Answer:")
    doc = tiny_tokenizer.encode("yes", add_special_tokens=False)
    after = tiny_tokenizer.encode("xyz", add_special_tokens=False)
    sampling = SamplingParams(temperature=0.0, max_tokens=60, structured=CHOICE)
    req = CachedRequest("r", prompt_ids + doc + list(eos) + after + list(eos), sampling, [], 0, len(prompt_ids))
    masks.register("r", CHOICE)
    assert masks.cut_drafts(req, after + list(eos)) == []  # advances to the end, feeds nothing past it
    assert masks._requests["r"].num_accepted == len(doc) + 1
    out = masks.apply(torch.zeros(1, len(tiny_tokenizer)), [req], lambda: None)  # [1, vocab]
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == list(eos)
