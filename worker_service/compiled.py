"""The compiled forward (`--no-enforce-eager`): each decoder layer through `torch.compile`
(inductor: C++/OpenMP kernels on CPU, Triton on CUDA) with dynamic shapes, so one graph serves
every token count above one and a second one single-token steps.

Regional compilation, as PyTorch's recipe for repeated blocks: the layers of a model are one
class run once per layer, and their graph inputs are their weights and their per-layer keys (the
layer's index and its packed weights' slots are 0-d host tensors, not int constants:
`layers/attention.py`, `layers/packed_linear.py`), so dynamo traces one layer, not the whole
stack, and every layer runs the same compiled code. Compiling the whole forward instead costs
dynamo a trace of every layer at every start (inductor's caches keep compiled kernels across
restarts, not dynamo's trace) for the fusions across a layer boundary; `benchmarks/startup.py`
and `benchmarks/compare.py` measure both ways. The embedding, the final norm and the head run
eagerly.

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
from torch import nn

from worker_service.layers.attention import ForwardContext, current_context

log = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_stepahead_cache() -> None:
    """Point inductor's on-disk caches into `$STEPAHEAD_CACHE_DIR` (an explicit setting wins)."""
    if INDUCTOR_CACHE_ENV not in os.environ:
        from model_zoo.builtin_models import cache_dir

        os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir() / "inductor")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the members of every `nn.ModuleList` of one class."""
    return [layer for module in model.modules() if isinstance(module, nn.ModuleList) and len(module) > 0
            and len({type(member) for member in module}) == 1 for layer in module]


def compile_forward(model: nn.Module) -> Callable[[torch.Tensor, ForwardContext], torch.Tensor]:
    """`forward(input_ids [n], ctx) -> hidden [n, hidden]` with its decoder layers compiled
    (each in place), run with `ctx` current."""
    use_stepahead_cache()
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers (an nn.ModuleList of one class) to compile")
    for layer in layers:
        layer.compile(dynamic=True)

    def forward(input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        with current_context(ctx):
            return model(input_ids, ctx)

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
