"""`stepahead serve --prefill-replicas 1 --decode-replicas 2`: a prefill worker (its own KV
transfer port) and two decode workers; greedy output through them equals Hugging Face's,
whichever replica computed which token, and no daemon logs a problem."""

from __future__ import annotations

from tests.fixtures_models import tiny_model_dir  # noqa: F401
from tests.service.harness import Serve
from tests.service.test_e2e import check_against_hf, random_prompts, run_concurrently


def test_disaggregated_serve_matches_hf(tiny_model_dir, hf):  # noqa: F811
    serve = Serve(tiny_model_dir, "--prefill-replicas", "1", "--decode-replicas", "2", capture_stderr=True)
    try:
        assert len(serve.child_pids()) == 5, "scheduler, a prefill worker, two decode workers, the gateway"
        prompts = random_prompts(8, 20, 120, 4096, seed=7)
        max_tokens = [12 + i for i in range(len(prompts))]
        outputs = run_concurrently(serve.gateway, prompts, max_tokens)
        check_against_hf(hf, prompts, outputs, max_tokens)
        stats = serve.stats()
        assert stats.num_running == 0
        if "num_loaded_blocks" in stats.DESCRIPTOR.fields_by_name:  # a scheduler that reports its transfers
            assert stats.num_handoffs >= len(prompts) and stats.num_loaded_blocks > 0, stats
            assert stats.num_failed_loads == 0 and stats.num_loading == 0, stats
    finally:
        serve.close()
    assert serve.log_problems() == []
