"""Every per-request path of a worker step fails its request alone: an exception injected for
ONE request of a batch in drafting, the grammar mask, bias / penalties, logprobs or the
min_tokens stop mask fails that request with the exception as its reason; the step, the
other requests (token for token as in the same batch run without the fault) and the worker
session go on. Plain and n-gram speculative steps, async scheduling (placeholder decodes).
"""

from __future__ import annotations

import random

import pytest

import worker_service.model_runner as model_runner
import worker_service.speculation as speculation
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from stepahead.plan import SamplingParams
from stepahead.speculative import SpeculativeConfig
from tests.integration.local_engine import LocalEngine
from testing.checkpoints import VARIANTS, VOCAB, build_checkpoint
from worker_service.grammar import GrammarMasks
from worker_service.input_batch import CachedRequest
from worker_service.logits_processing import LogitsProcessing
from worker_service.logprobs import StepLogprobs

POISONED = "p"
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model_type, overrides = VARIANTS["llama_tied_gqa4"]
    path = tmp_path_factory.mktemp("isolation")
    build_checkpoint(path, model_type, seed=2, **overrides)
    return path


def _mentions_poisoned(args) -> bool:
    for a in args:
        items = a if isinstance(a, (list, tuple)) else [a]
        for x in items:
            if x == POISONED or (isinstance(x, CachedRequest) and x.request_id == POISONED):
                return True
    return False


def _poison(fn, verify_arg: int | None):
    """fn raising for calls that concern the poisoned request; `verify_arg`: only for calls
    from speculative verification, told by that positional argument (drafts, rows) being set,
    so the fault hits the verify path and not a plain step before it."""
    def wrapped(*args, **kwargs):
        from_verify = verify_arg is None or (len(args) > verify_arg and args[verify_arg] is not None)
        if from_verify and _mentions_poisoned(args):
            raise RuntimeError(f"injected fault in {fn.__name__}")
        return fn(*args, **kwargs)
    return wrapped


# path -> per mode (plain, ngram): the (owner, attribute, argument telling a call from verify) patched
PATHS = {
    "drafting": {True: [(GrammarMasks, "cut_drafts", None)]},
    "grammar": {False: [(GrammarMasks, "apply", None)], True: [(GrammarMasks, "apply", 4)]},
    "penalties": {False: [(LogitsProcessing, "apply", None)], True: [(LogitsProcessing, "apply", 4)]},
    "logprobs": {False: [(StepLogprobs, "raw", None)], True: [(StepLogprobs, "raw_verified", None)]},
    "min_tokens": {False: [(model_runner, "mask_stops_before_min_tokens", None)],
                   True: [(speculation, "mask_stops_before_min_tokens", 3)]},
}


def _requests() -> dict[str, SamplingParams]:
    rng = random.Random(4)
    out = {}
    for i, rid in enumerate(["a", POISONED, "b", "c"]):
        unit = [rng.randrange(VOCAB) for _ in range(5)]
        # the poisoned request takes every path: min_tokens, logprobs, a penalty
        extra = dict(min_tokens=2, logprobs=1, repetition_penalty=1.3) if rid == POISONED else {}
        if rid == "c":
            extra = dict(logprobs=2, presence_penalty=0.5)
        sampling = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i, max_tokens=10, **extra)
        out[rid] = ((unit * 4)[:17], sampling)  # repeats itself: n-gram drafts
    return out


def _run(path, spec: bool, failures: dict[str, str]) -> LocalEngine:
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4) if spec else None
    runner = model_runner.ModelRunner(path, block_size=BLOCK, num_blocks=128, speculative_config=config)
    execute = runner.execute

    def recording(plan):
        result = execute(plan)
        failures.update(result.failed)
        return result

    runner.execute = recording
    engine = LocalEngine(runner, SchedulerConfig(
        num_gpu_blocks=128, num_cpu_blocks=0, max_model_len=runner.max_model_len, block_size=BLOCK,
        max_num_batched_tokens=128, async_scheduling=True, eos_token_ids=(),
        num_speculative_tokens=4 if spec else 0))
    for rid, (prompt, sampling) in _requests().items():
        engine.add(Request(rid, prompt, sampling))
    engine.run()
    engine.assert_no_leaks()
    return engine


@pytest.mark.parametrize(("path", "spec"), [(path, spec) for path, modes in PATHS.items() for spec in modes],
                         ids=lambda v: ("ngram" if v else "plain") if isinstance(v, bool) else v)
def test_a_fault_in_one_request_fails_it_alone(checkpoint, monkeypatch, path, spec):
    """(drafting runs with speculation only: it has no plain case)"""
    oracle_failures: dict[str, str] = {}
    oracle = _run(checkpoint, spec, oracle_failures)
    assert not oracle_failures
    for owner, name, verify_arg in PATHS[path][spec]:
        monkeypatch.setattr(owner, name, _poison(getattr(owner, name), verify_arg))
    failures: dict[str, str] = {}
    engine = _run(checkpoint, spec, failures)
    assert set(failures) == {POISONED}, failures
    assert "injected fault" in failures[POISONED]
    for rid in ("a", "b", "c"):
        assert engine.outputs[rid] == oracle.outputs[rid], rid
        assert len(engine.outputs[rid]) == 10
        if rid == "c":
            assert [lp.token_id for lp in engine.logprobs[rid]] == engine.outputs[rid]
    assert POISONED not in engine.runner.requests  # the failed request was forgotten at once
