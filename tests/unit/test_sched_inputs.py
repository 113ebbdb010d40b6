"""Bad input is rejected when added, with a message naming the problem; nothing hangs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request, RequestRejected
from scheduler_service.core.scheduler import Scheduler
from stepahead.plan import SamplingParams

CONFIG = SchedulerConfig(num_gpu_blocks=4, max_model_len=32, block_size=4)


def test_prompt_longer_than_max_model_len_is_rejected():
    sched = Scheduler(CONFIG)
    with pytest.raises(RequestRejected, match="prompt has 32 tokens; the model's maximum length is 32"):
        sched.add_request(Request("a", range(1, 33), SamplingParams(max_tokens=1)))
    assert not sched.has_unfinished_requests() and sched.schedule() is None


def test_request_needing_more_blocks_than_the_pool_is_rejected():
    sched = Scheduler(CONFIG)  # 4 blocks of 4 = 16 KV slots
    with pytest.raises(RequestRejected, match="needs up to 5 KV blocks .* only 4"):
        sched.add_request(Request("a", range(1, 11), SamplingParams(max_tokens=8)))
    # The largest request that fits: 16 KV positions (the 17th token is sampled, never computed).
    sched.add_request(Request("b", range(1, 11), SamplingParams(max_tokens=7)))
    assert sched.schedule() is not None


def test_duplicate_request_id_is_rejected():
    sched = Scheduler(CONFIG)
    sched.add_request(Request("a", [1], SamplingParams()))
    with pytest.raises(RequestRejected, match="duplicate request id 'a'"):
        sched.add_request(Request("a", [2], SamplingParams()))
    sched.check_integrity()


def test_aborting_an_unknown_id_is_a_no_op():
    sched = Scheduler(CONFIG)
    assert sched.abort("nope") is None
    sched.check_integrity()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"request_id": "", "prompt_token_ids": [1]}, "non-empty string"),
        ({"request_id": "a", "prompt_token_ids": []}, "the prompt is empty"),
        ({"request_id": "a", "prompt_token_ids": [1, -2]}, "non-negative"),
        ({"request_id": "a", "prompt_token_ids": [1], "sampling": SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"request_id": "a", "prompt_token_ids": [1], "sampling": SamplingParams(max_tokens=2, min_tokens=3)},
         "min_tokens"),
    ],
)
def test_malformed_requests_are_rejected(kwargs, message):
    kwargs.setdefault("sampling", SamplingParams())
    with pytest.raises(RequestRejected, match=message):
        Request(**kwargs)


def test_a_request_object_cannot_be_added_twice():
    sched = Scheduler(CONFIG)
    req = Request("a", [1], SamplingParams(max_tokens=1))
    sched.add_request(req)
    sched.abort("a")
    with pytest.raises(RequestRejected, match="already used"):
        sched.add_request(req)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"num_cpu_blocks": -1}, "num_cpu_blocks"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "without chunked prefill"),
        ({"scheduling_policy": "lottery"}, "lottery"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches"),
    ],
)
def test_bad_config_is_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        replace(CONFIG, **change)


def test_a_request_longer_than_the_pool_fits_when_every_layer_is_windowed():
    """50 tokens need 13 blocks of 4 whole, more than the pool's 8; with every layer windowed
    (6 keys) the request holds only its window's blocks and what its plans in flight schedule,
    so it is admitted and runs to its end (the fake worker checks every key it reads)."""
    from tests.unit.fake_executor import Driver, RequestSpec, hashed_tokens, run_alone

    config = SchedulerConfig(num_gpu_blocks=8, max_model_len=64, block_size=4, max_num_batched_tokens=4,
                             max_concurrent_batches=2)
    spec = RequestSpec("a", tuple(range(1, 11)), SamplingParams(max_tokens=40, ignore_eos=True))
    tokens = hashed_tokens(vocab_size=50)
    with pytest.raises(RequestRejected, match="needs up to 13 KV blocks"):
        Scheduler(config).add_request(spec.build())
    windowed = replace(config, sliding_window=6)
    driver = Driver.create(windowed, tokens)
    driver.scheduler.add_request(spec.build())
    driver.run_until_done()
    want, _ = run_alone(replace(config, num_gpu_blocks=16), spec, tokens)
    assert driver.outputs["a"] == want
    stats = driver.scheduler.stats()
    assert stats.num_slid_blocks > 0 and stats.num_preemptions == 0
    assert stats.num_free_blocks == stats.num_total_blocks
