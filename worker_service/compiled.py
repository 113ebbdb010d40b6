"""The compiled forward (`--no-enforce-eager`): the model's `forward(input_ids, ctx)` through
`torch.compile` (inductor: C++/OpenMP kernels on CPU, Triton on CUDA) with dynamic shapes, so
one graph serves every token count above one and a second one single-token steps.

The paged attention of each layer stays an opaque op (`layers/attention.py`,
`stepahead::paged_attention`); everything between (norms, rotary, activations, residuals,
projections) is compiled and fused. Inductor's caches go under `$STEPAHEAD_CACHE_DIR/inductor`
unless `TORCHINDUCTOR_CACHE_DIR` is set, so a restart reuses the compiled kernels. `warm_up`
compiles the shapes a server meets (one decode, several decodes, a prompt chunk) at start-up,
before the first request, and logs how long that took.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from worker_service.layers.attention import ForwardContext, current_context

log = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_stepahead_cache() -> None:
    """Point inductor's on-disk caches into `$STEPAHEAD_CACHE_DIR` (an explicit setting wins)."""
    if INDUCTOR_CACHE_ENV not in os.environ:
        from model_zoo.builtin_models import cache_dir

        os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir() / "inductor")


def compile_forward(model: torch.nn.Module) -> Callable[[torch.Tensor, ForwardContext], torch.Tensor]:
    """`forward(input_ids [n], ctx) -> hidden [n, hidden]` compiled, run with `ctx` current."""
    use_stepahead_cache()
    compiled = torch.compile(model.forward, dynamic=True)

    def forward(input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        with current_context(ctx):
            return compiled(input_ids, ctx)

    return forward


def warm_up(runner) -> float:
    """Compile (or load from the cache) the graphs the steps will use; returns the seconds taken."""
    from worker_service.memory_profile import dummy_steps

    start = time.perf_counter()
    decodes = min(2, runner.max_num_seqs, runner.max_num_batched_tokens)
    chunk = min(4, runner.max_num_batched_tokens, runner.max_model_len)
    shapes = [[(runner.max_model_len, runner.max_model_len - 1, 1)],  # one decode: its own graph
              [(runner.max_model_len, runner.max_model_len - 1, 1)] * decodes,  # several: the dynamic one
              [(chunk, 0, chunk)]]  # a prompt chunk
    dummy_steps(runner, shapes, sample=False)
    seconds = time.perf_counter() - start
    log.info("compiled forward warmed up in %.1f s (inductor cache %s)", seconds, os.environ[INDUCTOR_CACHE_ENV])
    return seconds
