"""The worker daemon's flags (`stepahead worker --help`): one field per flag, in groups.

`WorkerEngineConfig` and the shared groups of `stepahead.knobs` are what `stepahead serve`
hands every worker it starts; `WorkerProcessConfig` is each process's own (where it dials,
its ports, logging).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from model_zoo.builtin_models import DEFAULT_MODEL, MODEL_HELP
from stepahead import config as cfg
from stepahead.heap import gc_warning_threshold_field
from stepahead.knobs import KVCacheConfig, SimDeviceConfig, SpeculativeFlag, StepBudgetConfig
from stepahead.logprobs import MAX_LOGPROBS
from stepahead.plan import WorkerRole
from stepahead.security import SchedulerClientConfig, TLSFiles
from worker_service.attention_names import AttentionBackendName


class WeightDType(enum.Enum):
    """Values of `--dtype` (the torch dtypes are `worker_service.loader.DTYPES`)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


@dataclass(frozen=True)
class WorkerProcessConfig(SchedulerClientConfig):
    """Where this worker dials, what it serves on the side, how it logs."""

    scheduler: str = cfg.field("127.0.0.1:50051", "scheduler address to attach to")
    model: str = cfg.field(DEFAULT_MODEL, MODEL_HELP)
    reconnect_max_backoff_s: float = cfg.field(5.0, "longest wait between attach attempts")
    advertise_host: str | None = cfg.field(
        None, "host the other ranks reach this worker's rendezvous at, should it be rank 0 (default: the "
        "address the scheduler sees)")
    metrics_port: int | None = cfg.field(None, "serve Prometheus /metrics on this port (off when unset)")
    health_port: int | None = cfg.field(
        None, "serve gRPC health (grpc.health.v1) on this port for readiness probes: SERVING while attached "
        "to a scheduler, NOT_SERVING while loading, re-attaching or draining (off when unset)")
    health_host: str = cfg.field("127.0.0.1", "address --health-port listens on (0.0.0.0 for Kubernetes probes)")
    log_level: str = cfg.field("info", "log level")
    gc_warning_threshold_secs: float = gc_warning_threshold_field()


@dataclass(frozen=True)
class WorkerEngineConfig:
    """The model and how it runs (with the shared groups: what `stepahead serve` forwards)."""

    served_model_name: str | None = cfg.field(None, "name clients use (default: the --model argument, as vLLM)")
    tokenizer: str | None = cfg.field(None, "tokenizer directory for a .gguf --model that carries none")
    dtype: WeightDType | None = cfg.field(
        None, "weight dtype (default: float32; sim: the checkpoint's torch_dtype)")
    device: str = cfg.field("cpu", "torch device: cpu, cuda, cuda:1, or sim (a simulated accelerator, no torch)")
    sim_eos_probability: float = cfg.field(0.01, "--device sim: chance that a sampled token is EOS")
    kv_cache_memory_bytes: int | None = cfg.field(None, "KV cache size in bytes (CPU default: a quarter of the host memory left after the weights, at most what --max-num-seqs sequences of --max-model-len fill; CUDA: --gpu-memory-utilization)")
    max_model_len: int | None = cfg.field(None, "maximum prompt + output tokens (default: the model's)")
    attention_backend: AttentionBackendName = cfg.field(
        AttentionBackendName.AUTO, "paged attention: auto (CPU float32: a C++ decode kernel over the paged "
        "cache, built once into $STEPAHEAD_CACHE_DIR; with CUDA graphs: paged; otherwise torch), torch (reference: "
        "gather, then SDPA), "
        "paged (device-side decode metadata, bucketed shapes; flash-attn's paged KV kernel when installed) or "
        "flashinfer (CUDA, float16/bfloat16, flashinfer-python installed: its paged decode and prefill kernels)")
    enforce_eager: bool = cfg.field(
        True, "run the model's forward eagerly, no torch.compile (--no-enforce-eager compiles it with inductor, "
        "warmed up at start-up, its cache in $STEPAHEAD_CACHE_DIR/inductor: faster steps on CPU for tens of "
        "seconds more at every start, docs/benchmarks.md; on CUDA it also replays decode steps from CUDA graphs)")
    cuda_graph_sizes: tuple[str, ...] = cfg.field(
        (), "CUDA, --no-enforce-eager: the decode batch sizes replayed from captured CUDA graphs, each a size "
        "decode-only steps are padded to (1, 2, 4, 8, then multiples of 8); a graph per size and block-table "
        "width, captured on its first step (default: every such size up to --max-cuda-graph-batch-size)")
    max_cuda_graph_batch_size: int = cfg.field(
        512, "CUDA, --no-enforce-eager: the largest decode batch replayed from a CUDA graph (0: none, the compiled "
        "forward alone)")
    cpu_prepack_weights: bool = cfg.field(
        True, "CPU, float32 or bfloat16, eager: hold every linear layer's weight in oneDNN's packed layout, "
        "blocked once at load for its matmul kernels (faster decode steps on models of real size: "
        "docs/benchmarks.md, 'Real models on CPU'); --no-cpu-prepack-weights runs plain F.linear")
    seed: int = cfg.field(0, "seed of unseeded sampling")
    structured_outputs_cache_size: int = cfg.field(
        256, "compiled grammars (structured outputs) kept per worker, least recently used evicted")
    max_logprobs: int = cfg.field(
        MAX_LOGPROBS, "largest logprobs / prompt_logprobs k a request may ask for (announced to the scheduler "
        "and gateways, which refuse larger ones)")
    sim_acceptance_rate: float = cfg.field(
        0.7, "--device sim with --speculative-config: chance that each draft is accepted")
    num_threads: int | None = cfg.field(
        None, "torch intra-op threads on CPU (default: torch's choice; serve: one core less than the machine)"
    )
    tensor_parallel_size: int = cfg.field(
        1, "ranks of this worker's tensor-parallel group: the scheduler groups workers of the same size in "
        "attach order, each loads 1/k of the weights (torch.distributed)")
    enable_expert_parallel: bool = cfg.field(
        False, "Mixture-of-Experts models: place whole experts on the tensor-parallel ranks (1/k of the experts "
        "each) instead of 1/k of every expert's width; attention stays tensor-parallel")
    distributed_backend: str | None = cfg.field(None, "torch.distributed backend (default: gloo on CPU, nccl on CUDA)")
    distributed_timeout: float = cfg.field(
        60.0, "seconds a tensor-parallel rendezvous or collective may take before the group is torn down")
    kv_transfer_timeout: float = cfg.field(
        30.0, "disaggregation: seconds one KV load (reading a prefilled prompt's blocks from a prefill worker) "
        "may take before it is reported failed")
    sim_kv_link: str = cfg.field(
        "ib", "--device sim: the link KV loads cross between replicas: ib, nvlink, pcie or a JSON file "
        "(docs/sim.md)")


@dataclass(frozen=True)
class KVTransferConfig:
    """This worker's part in disaggregated prefill/decode (docs/disaggregation.md): its role, and
    the KVTransfer service a prefill worker serves its prefilled blocks on."""

    role: WorkerRole = cfg.field(
        WorkerRole.BOTH, "what this replica does: both (prefill and decode), prefill (new prompts; their KV then "
        "moves to a decode replica) or decode (continues requests prefilled elsewhere)")
    kv_transfer_host: str = cfg.field("127.0.0.1", "address the KVTransfer service listens on (role prefill)")
    kv_transfer_port: int = cfg.field(0, "port of the KVTransfer service (role prefill; 0 picks a free one)")
    kv_transfer_advertise_host: str | None = cfg.field(
        None, "host decode workers reach the KVTransfer service at, announced to the scheduler (default: "
        "--kv-transfer-host)")
    kv_transfer_ssl_certfile: str | None = cfg.field(None, "TLS certificate (PEM) of the KVTransfer service")
    kv_transfer_ssl_keyfile: str | None = cfg.field(None, "TLS private key (PEM) of the KVTransfer service")
    kv_transfer_ssl_ca_certs: str | None = cfg.field(
        None, "CA bundle: the KVTransfer service requires client certificates signed by it (mTLS)")

    @property
    def serves_kv_transfer(self) -> bool:
        return self.role is WorkerRole.PREFILL

    def kv_transfer_tls(self) -> TLSFiles:
        return TLSFiles(self.kv_transfer_ssl_certfile, self.kv_transfer_ssl_keyfile, self.kv_transfer_ssl_ca_certs)


@dataclass(frozen=True)
class WorkerConfig(WorkerEngineConfig, SpeculativeFlag, StepBudgetConfig, SimDeviceConfig, KVCacheConfig,
                   KVTransferConfig, WorkerProcessConfig):
    """`stepahead worker`'s flags."""


# what `stepahead serve` hands each worker (the rest is per process, or set by serve itself)
SERVED_GROUPS = (KVCacheConfig, SimDeviceConfig, StepBudgetConfig, SpeculativeFlag, WorkerEngineConfig)
