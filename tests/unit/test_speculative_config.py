"""`--speculative-config` parsing (vLLM's JSON format) and the n-gram proposer."""

from __future__ import annotations

import pytest

from scheduler_service.core.config import SchedulerConfig
from stepahead.config import ConfigError
from stepahead.speculative import SpeculativeConfig, num_speculative_tokens, parse_speculative_config
from worker_service.ngram import propose_ngram


def test_parses_vllm_format():
    raw = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    assert parse_speculative_config(raw) == SpeculativeConfig(4, 2, 5)
    assert num_speculative_tokens(raw) == 4
    assert parse_speculative_config(None) is None and parse_speculative_config("  ") is None
    assert num_speculative_tokens(None) == 0
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(3, 1, 3)


@pytest.mark.parametrize("raw, named", [
    ("[1, 2]", "JSON object"),
    ("{", "not valid JSON"),
    ('{"num_speculative_tokens": 2}', "'method'"),
    ('{"method": "ngram"}', "'num_speculative_tokens'"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}', "draft_model"),
])
def test_bad_configs_name_the_field(raw, named):
    with pytest.raises(ConfigError, match=named):
        parse_speculative_config(raw)


def test_scheduler_config_bounds_k():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SchedulerConfig(num_gpu_blocks=4, max_model_len=16, num_speculative_tokens=-1)


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 5]  # "1 2 3" last seen before 7 8 5
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]
    assert propose_ngram([4, 5, 6, 4], 3, 1, 2) == [5, 6, 4]  # only the 1-gram "4" matches
    assert propose_ngram([4, 5, 6, 4], 3, 2, 2) == []
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([5, 5], 4, 1, 1) == [5]  # overlapping match: what follows the first 5
    assert propose_ngram([7], 2, 1, 3) == []
