"""The worker daemon's flags (`stepahead worker --help`): one field per flag."""

from __future__ import annotations

from dataclasses import dataclass

from model_zoo.builtin_models import DEFAULT_MODEL, MODEL_HELP
from stepahead import config as cfg
from stepahead.heap import gc_warning_threshold_field
from stepahead.logprobs import MAX_LOGPROBS
from stepahead.security import SchedulerClientConfig
from worker_service.attention_names import AttentionBackendName


@dataclass(frozen=True)
class WorkerConfig(SchedulerClientConfig):
    scheduler: str = cfg.field("127.0.0.1:50051", "scheduler address to attach to")
    model: str = cfg.field(DEFAULT_MODEL, MODEL_HELP)
    served_model_name: str | None = cfg.field(None, "name clients use (default: the --model argument, as vLLM)")
    tokenizer: str | None = cfg.field(None, "tokenizer directory for a .gguf --model that carries none")
    dtype: str | None = cfg.field(
        None, "weight dtype: float32, bfloat16, float16 (default: float32; sim: the checkpoint's torch_dtype)")
    device: str = cfg.field("cpu", "torch device: cpu, cuda, cuda:1, or sim (a simulated accelerator, no torch)")
    sim_profile: str = cfg.field("h100", "--device sim: accelerator profile h100, h200, a100 or a JSON file")
    sim_num_devices: int = cfg.field(1, "--device sim: accelerators per replica (ideal tensor parallelism)")
    sim_eos_probability: float = cfg.field(0.01, "--device sim: chance that a sampled token is EOS")
    block_size: int = cfg.field(16, "tokens per KV block")
    kv_cache_memory_bytes: int | None = cfg.field(None, "KV cache size in bytes (CPU default 512 MiB)")
    gpu_memory_utilization: float = cfg.field(
        0.9, "fraction of the CUDA device's total memory this worker may use; the KV cache gets what a "
        "profiling step at max_num_seqs / max_num_batched_tokens leaves of it")
    num_gpu_blocks_override: int | None = cfg.field(None, "exact number of device KV blocks (tests)")
    swap_space: float = cfg.field(1.0, "host memory for swapped-out KV blocks, GiB")
    max_model_len: int | None = cfg.field(None, "maximum prompt + output tokens (default: the model's)")
    max_num_seqs: int = cfg.field(256, "requests per step the input buffers are sized (and profiled) for")
    max_num_batched_tokens: int = cfg.field(2048, "tokens per step the input buffers are sized (and profiled) for")
    attention_backend: AttentionBackendName = cfg.field(
        AttentionBackendName.TORCH, "paged attention: torch (reference) or paged (device-side decode "
        "metadata, bucketed shapes; flash-attn's paged KV kernel when installed)")
    seed: int = cfg.field(0, "seed of unseeded sampling")
    structured_outputs_cache_size: int = cfg.field(
        256, "compiled grammars (structured outputs) kept per worker, least recently used evicted")
    max_logprobs: int = cfg.field(
        MAX_LOGPROBS, "largest logprobs / prompt_logprobs k a request may ask for (announced to the scheduler "
        "and gateways, which refuse larger ones)")
    speculative_config: str | None = cfg.field(
        None, "n-gram speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": K, "
              "\"prompt_lookup_min\": a, \"prompt_lookup_max\": b}' (docs/speculative-decoding.md)")
    sim_acceptance_rate: float = cfg.field(
        0.7, "--device sim with --speculative-config: chance that each draft is accepted")
    num_threads: int | None = cfg.field(
        None, "torch intra-op threads on CPU (default: torch's choice; serve: one core less than the machine)"
    )
    reconnect_max_backoff_s: float = cfg.field(5.0, "longest wait between attach attempts")
    tensor_parallel_size: int = cfg.field(
        1, "ranks of this worker's tensor-parallel group: the scheduler groups workers of the same size in "
        "attach order, each loads 1/k of the weights (torch.distributed)")
    advertise_host: str | None = cfg.field(
        None, "host the other ranks reach this worker's rendezvous at, should it be rank 0 (default: the "
        "address the scheduler sees)")
    distributed_backend: str | None = cfg.field(None, "torch.distributed backend (default: gloo on CPU, nccl on CUDA)")
    distributed_timeout: float = cfg.field(
        60.0, "seconds a tensor-parallel rendezvous or collective may take before the group is torn down")
    metrics_port: int | None = cfg.field(None, "serve Prometheus /metrics on this port (off when unset)")
    health_port: int | None = cfg.field(
        None, "serve gRPC health (grpc.health.v1) on this port for readiness probes: SERVING while attached "
        "to a scheduler, NOT_SERVING while loading, re-attaching or draining (off when unset)")
    health_host: str = cfg.field("127.0.0.1", "address --health-port listens on (0.0.0.0 for Kubernetes probes)")
    log_level: str = cfg.field("info", "log level")
    gc_warning_threshold_secs: float = gc_warning_threshold_field()
