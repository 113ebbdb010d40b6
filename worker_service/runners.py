"""What the worker daemon drives, and how it is built from the flags.

`Runner` is the interface the attach session needs from a model runner: the torch runner
(`model_runner.ModelRunner`), its tensor-parallel rank (`parallel.runner.TPModelRunner`)
and the simulated accelerator (`sim.runner.SimRunner`) all provide it. `build_runner`
picks one for a `WorkerConfig`; `worker_info` is the hello a runner announces.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from stepahead.plan import StepPlan, StepResult, WorkerInfo
from stepahead.speculative import parse_speculative_config
from worker_service.config import WorkerConfig

if TYPE_CHECKING:
    from worker_service.decode_graphs import GraphSettings


class PendingStep(Protocol):
    """A launched step; `wait()` blocks until its sampled ids reach the host."""

    def wait(self) -> StepResult: ...


class Runner(Protocol):
    """A model runner as the attach session uses it (`attach.Pipeline`, `worker_info`)."""

    model_type: str
    dtype: object  # a torch.dtype, or the sim runner's dtype name
    device: object  # a torch.device, or the sim runner's "sim:<profile>"
    block_size: int
    num_blocks: int  # device KV blocks
    num_host_blocks: int  # host (swap) KV blocks
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] | list[int]
    max_logprobs: int  # 0: logprobs are not computed
    computes_logprobs: bool
    supports_structured_outputs: bool
    grammar: object | None  # the compiled-grammar cache the metrics watch, when there is one
    sliding_window: int  # the window every attention layer applies; 0: some layer sees the whole context
    num_offload_blocks: int  # host blocks --kv-offloading-size added for the prefix cache's host tier (0: off)
    # KV transfers (disaggregation): `kv_transfer` reads blocks for other workers, `kv_loads` writes them
    holds_kv: bool  # a block's bytes travel (the sim runner holds none: its chunks carry no data)
    kv_bytes_per_block: int
    kv_loader: object | None  # the attach session's `kv_loads.KVLoader` (set by `attach_once`)

    def launch(self, plan: StepPlan, received: float = 0.0) -> PendingStep:
        """Check `plan` and start it on the device; raise on a plan the worker cannot run."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """`launch(plan).wait()`: the synchronous form (tests, the offline simulator)."""
        ...

    def reset(self) -> None:
        """Forget every request (the scheduler forgot them: a new attach session)."""
        ...

    def read_kv_blocks(self, block_ids: list[int]) -> bytes:
        """The bytes of device blocks, block after block, from any thread (no plan writes them meanwhile)."""
        ...

    def write_kv_blocks(self, block_ids: list[int], data: bytes) -> None:
        """Device blocks from another worker's `read_kv_blocks`, from a loader thread."""
        ...

    def kv_link_seconds(self, nbytes: int) -> float:
        """The simulated link's time for a load of `nbytes` (0: a real transfer took its own)."""
        ...


def build_runner(config: WorkerConfig, group=None) -> tuple[Runner, Path]:
    """(runner, model dir); `group` (a `parallel.group.GroupSpec`): this rank's shard only."""
    if config.device == "sim":
        from worker_service.sim.build import build_sim_runner

        return build_sim_runner(config)
    import torch

    from model_zoo.builtin_models import resolve_model
    from worker_service.kv_cache import block_bytes
    from worker_service.loader import parse_dtype
    from worker_service.model_config import ModelConfig
    from worker_service.model_runner import ModelRunner
    from worker_service.paged_attention import make_backend

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model(config.model, tokenizer=config.tokenizer)
    model_cfg = ModelConfig.from_dir(model_dir)
    dtype = config.dtype.value if config.dtype else "float32"
    check_weights_fit(model_dir, model_cfg, config, parse_dtype(dtype).itemsize)
    host_blocks, offload_blocks = config.host_blocks(block_bytes(model_cfg, config.block_size, parse_dtype(dtype)))
    enforce_eager = resolve_enforce_eager(config, group is not None)
    graphs = resolve_decode_graphs(config, enforce_eager)
    runner_class = ModelRunner
    if group is not None:
        from functools import partial

        from worker_service.parallel.runner import TPModelRunner

        runner_class = partial(TPModelRunner, rank=group.rank, size=group.size,
                               expert_parallel=config.enable_expert_parallel)
    runner = runner_class(
        model_dir,
        dtype=dtype,
        device=config.device,
        block_size=config.block_size,
        kv_cache_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_blocks=config.num_gpu_blocks_override,
        num_host_blocks=host_blocks,
        num_offload_blocks=offload_blocks,
        max_model_len=config.max_model_len,
        seed=config.seed,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_logprobs=config.max_logprobs,
        attention_backend=make_backend(config.attention_backend, torch.device(config.device), parse_dtype(dtype),
                                       config.block_size, graphs=graphs is not None),
        speculative_config=parse_speculative_config(config.speculative_config),
        structured_outputs_cache_size=config.structured_outputs_cache_size,
        enforce_eager=enforce_eager,
        pack_weights=config.cpu_prepack_weights,
        decode_graphs=graphs,
    )
    return runner, model_dir


def resolve_enforce_eager(config: WorkerConfig, tensor_parallel: bool) -> bool:
    """--enforce-eager (the compiled forward is opt-in: docs/benchmarks.md, "Compiled and fused
    steps"); a tensor-parallel rank runs eagerly (its collectives are not traced)."""
    if tensor_parallel and not config.enforce_eager:
        raise ValueError("--no-enforce-eager: the compiled forward does not run tensor-parallel")
    return config.enforce_eager


def check_device_flags(config: WorkerConfig) -> None:
    """Before the model loads: a device, attention backend or CUDA-graph flag this machine cannot honour
    raises ValueError, one line naming the flag."""
    resolve_decode_graphs(config, config.enforce_eager)
    if config.device == "sim":
        return
    import torch

    from worker_service.attention_names import AttentionBackendName
    from worker_service.loader import parse_dtype

    try:
        device = torch.device(config.device)
    except RuntimeError as exc:
        raise ValueError(f"--device {config.device}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {config.device}: torch {torch.__version__} sees no CUDA device here")
    if config.attention_backend is AttentionBackendName.FLASHINFER:
        from worker_service.flashinfer_attention import flashinfer_usable

        why = flashinfer_usable(device, parse_dtype(config.dtype.value if config.dtype else "float32"))
        if why is not None:
            raise ValueError(why)


def resolve_decode_graphs(config: WorkerConfig, enforce_eager: bool) -> GraphSettings | None:
    """The decode CUDA graphs of a compiled forward on CUDA (`worker_service/decode_graphs.py`), else None."""
    if config.max_cuda_graph_batch_size < 0:
        raise ValueError(f"--max-cuda-graph-batch-size must be >= 0, got {config.max_cuda_graph_batch_size}")
    try:
        sizes = tuple(int(size) for size in config.cuda_graph_sizes)
    except ValueError:
        raise ValueError(f"--cuda-graph-sizes: integers, got {','.join(config.cuda_graph_sizes)!r}") from None
    if enforce_eager or not config.device.startswith("cuda") or config.max_cuda_graph_batch_size == 0:
        return None
    from worker_service.decode_graphs import GraphSettings, graph_sizes

    return GraphSettings(graph_sizes(sizes, config.max_cuda_graph_batch_size, config.max_num_seqs))


def check_weights_fit(model_dir, model_cfg, config: WorkerConfig, bytes_per_param: int) -> None:
    """Before anything is allocated: a checkpoint whose config describes more weights than the
    device (its --gpu-memory-utilization share) or the host holds would otherwise run for
    minutes building layers, or be killed for memory, instead of failing."""
    from worker_service.model_config import check_fits, host_memory_bytes

    share = max(config.tensor_parallel_size, 1)  # each rank holds 1/k of the weights
    if config.device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(config.device)).total_memory
        check_fits(model_dir, model_cfg, bytes_per_param, int(total * config.gpu_memory_utilization) * share,
                   f"{config.device} at --gpu-memory-utilization {config.gpu_memory_utilization}")
    else:
        check_fits(model_dir, model_cfg, bytes_per_param, host_memory_bytes() * share, "the host")


def log_kv_capacity(log, info: WorkerInfo) -> None:
    """What the KV cache holds, as vLLM reports it at start-up: tokens, and requests of the
    model's full length at once (a workload that needs more preempts)."""
    tokens = info.num_device_blocks * info.block_size
    log.info("kv_cache_capacity", tokens=tokens, blocks=info.num_device_blocks, block_size=info.block_size,
             max_model_len=info.max_model_len, full_length_requests=round(tokens / max(info.max_model_len, 1), 2),
             host_swap_tokens=info.num_host_blocks * info.block_size)


def worker_info(config: WorkerConfig, runner: Runner, model_dir: Path | str) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"{socket.gethostname()}:{os.getpid()}",
        model_name=config.served_model_name or config.model,
        model_type=runner.model_type,
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
        block_size=runner.block_size,
        num_device_blocks=runner.num_blocks,
        num_host_blocks=runner.num_host_blocks,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=tuple(runner.eos_token_ids),
        max_logprobs=runner.max_logprobs,
        logprobs=runner.computes_logprobs,
        structured_outputs=runner.supports_structured_outputs,
        prepares_grammars=runner.supports_structured_outputs,  # every runner with grammars prepares them
        sliding_window=runner.sliding_window,
        num_offload_blocks=runner.num_offload_blocks,
        role=config.role,
    )
