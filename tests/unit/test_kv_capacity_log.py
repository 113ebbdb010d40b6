"""The worker says at start-up what its KV cache holds (tokens, full-length requests), as vLLM does."""

from __future__ import annotations

from stepahead.plan import WorkerInfo
from worker_service.runners import log_kv_capacity


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.events.append((event, fields))


def test_capacity_in_tokens_and_full_length_requests():
    info = WorkerInfo(worker_id="w", model_name="m", model_type="llama", dtype="float32", device="cpu",
                      block_size=16, num_device_blocks=728, num_host_blocks=1456, max_model_len=8192,
                      vocab_size=49152, eos_token_ids=(2,))
    log = _Log()
    log_kv_capacity(log, info)
    [(event, fields)] = log.events
    assert event == "kv_cache_capacity"
    assert fields["tokens"] == 728 * 16 and fields["host_swap_tokens"] == 1456 * 16
    assert fields["full_length_requests"] == round(728 * 16 / 8192, 2)
