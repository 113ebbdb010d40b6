"""KV cache sizing on CUDA after a profiling run at the largest step shapes (as vLLM does).

`gpu_memory_utilization` is the fraction of the device's total memory this worker may use.
The KV cache gets what is left of it after the weights, the peak of a profiling step
(activations, the attention gather buffer, logits, sampling temporaries: everything a
step allocates and frees) and the memory outside torch's allocator (CUDA context, ...).
The split is logged once at start-up (`kv_cache_memory`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from stepahead.plan import SamplingParams
from worker_service.input_batch import CachedRequest, RequestTable, ScheduledBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySplit:
    """Bytes of device memory by use."""

    total: int
    budget: int  # total * gpu_memory_utilization
    weights: int  # allocated before the profiling run: weights, rotary table, step buffers
    step_peak: int  # peak allocated during the profiling run, beyond `weights`
    non_torch: int  # device memory in use outside torch's caching allocator
    kv_cache: int  # what is left for the KV cache


def split_memory(total: int, utilization: float, weights: int, peak_allocated: int, non_torch: int) -> MemorySplit:
    """peak_allocated: torch's peak allocation over the profiling run (weights included)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization)
    kv = budget - peak_allocated - non_torch
    split = MemorySplit(total, budget, weights, peak_allocated - weights, non_torch, kv)
    if kv <= 0:
        raise ValueError(f"no device memory left for the KV cache: {split}; raise --gpu-memory-utilization "
                         "or lower --max-num-seqs / --max-num-batched-tokens / --max-model-len")
    return split


def profile_memory(runner, utilization: float) -> MemorySplit:
    """Run `profile_run` on the runner's device; the split says what the KV cache may take."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    try:
        profile_run(runner)
    except torch.cuda.OutOfMemoryError as exc:
        raise ValueError(f"the profiling step (max_num_seqs={runner.max_num_seqs}, max_num_batched_tokens="
                         f"{runner.max_num_batched_tokens}, max_model_len={runner.max_model_len}) ran out of "
                         "device memory; lower one of them") from exc
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    split = split_memory(total, utilization, weights, peak, non_torch)
    log.info("kv_cache_memory total=%d budget=%d weights=%d step_peak=%d non_torch=%d kv_cache=%d",
             split.total, split.budget, split.weights, split.step_peak, split.non_torch, split.kv_cache)
    return split


@torch.inference_mode()
def profile_run(runner) -> None:
    """One prefill at the token budget, then one decode batch of max_num_seqs requests at
    max_model_len: the largest activations, gather buffers, logits and sampling temporaries a
    step can need (`dummy_steps`)."""
    max_len = runner.max_model_len
    prefill, left = [], runner.max_num_batched_tokens
    while left > 0 and len(prefill) < runner.max_num_seqs:
        n = min(left, max_len)
        prefill.append((n, 0, n))  # (known tokens, computed, scheduled)
        left -= n
    num_decodes = min(runner.max_num_seqs, runner.max_num_batched_tokens)
    dummy_steps(runner, [prefill, [(max_len, max_len - 1, 1)] * num_decodes], sample=True)


@torch.inference_mode()
def dummy_steps(runner, shapes: list[list[tuple[int, int, int]]], sample: bool) -> None:
    """One step per shape, each a list of requests (known tokens, computed, scheduled), every
    KV write to the dummy block; forward, and sampling when `sample`. No request state is left
    behind (the memory profile, the compiled forward's warm-up)."""
    dummy, width = runner.kv_cache.dummy_block, runner.max_blocks_per_req
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0)  # the sort path
    with runner.streams.on_compute_stream():
        for shape in shapes:
            table = RequestTable(width, dummy, rows=len(shape))
            sched = ScheduledBatch()
            tokens = {known: [0] * known for known, _, _ in set(shape)}  # shared: max_model_len can be 128k
            for i, (known, computed, scheduled) in enumerate(shape):
                state = CachedRequest(f"profile-{i}", tokens[known], sampling, [], computed, known)
                state.row = table.add([dummy] * width)
                sched.add(state, scheduled, False)
            saved, runner.table = runner.table, table
            try:
                inputs = runner._copy_inputs(sched, 0)
                logits = runner._forward(inputs)
                if sample:
                    runner._sample(logits, inputs.sampling_reqs)
            finally:
                runner.table = saved
    runner.last_logits, runner.last_logits_ids = None, ()
