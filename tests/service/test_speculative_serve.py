"""N-gram speculative decoding through all three daemons: `stepahead serve
--speculative-config ...` gives Hugging Face's greedy text, reports acceptance in the
usage and the scheduler's stats; a bad config stops the daemon with the field named."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401
from tests.service.harness import Serve
from tests.service.hf_oracle import HFGreedy
from tests.service.test_openai_http import assert_hf_text, hf_text

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def serve(tiny_model_dir):  # noqa: F811
    with Serve(tiny_model_dir, "--max-num-seqs", "8", "--speculative-config", SPEC, capture_stderr=True) as s:
        yield s
        assert not s.log_problems(), s.log_problems()  # a step that failed and was retried is a failure


def test_greedy_text_equals_hf_and_usage_reports_acceptance(serve, tiny_model_dir, tiny_tokenizer):  # noqa: F811
    prompt = "a" * 28  # the random tiny model repeats itself here, so n-gram lookup finds drafts
    with openai.OpenAI(base_url=serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert_hf_text(out.choices[0].text, hf_text(HFGreedy(tiny_model_dir), tiny_tokenizer,
                                                tiny_tokenizer.encode(prompt), 32))
    assert out.usage.completion_tokens == 32
    spec = out.usage.model_extra["speculative_decoding"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"], abs=1e-6)
    assert spec["mean_accepted_length"] >= 1.0
    stats = serve.stats()
    assert stats.spec_num_draft_tokens >= spec["draft_tokens"]
    assert stats.spec_num_accepted_tokens >= spec["accepted_tokens"]


@pytest.mark.parametrize("bad, field", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram"', "not valid JSON"),
])
def test_bad_config_exits_naming_the_field(bad, field):
    proc = subprocess.run([sys.executable, "-m", "cli", "scheduler", "--port", "0",
                           "--speculative-config", bad], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert field in proc.stdout + proc.stderr
