"""The worker daemon: loads a model, dials the scheduler, executes plans in order.

    stepahead worker --scheduler 127.0.0.1:50051 --model tiny

The worker is a gRPC *client*: it opens AttachWorker on the scheduler, says hello with its
model and KV geometry, then executes each plan it receives and answers with the result
on the same stream. When the stream breaks it forgets every request and dials again with
exponential backoff, so a restarted scheduler gets a clean worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from prometheus_client import REGISTRY, start_http_server

from stepahead.speculative import parse_speculative_config
from stepahead.builtin_models import DEFAULT_MODEL, MODEL_HELP
from stepahead import codec, daemon, jitter, logs
from stepahead.heap import GcPauses, freeze_heap, gc_warning_threshold_field
from stepahead import config as cfg
from stepahead.logprobs import MAX_LOGPROBS
from stepahead.plan import WorkerInfo
from worker_service.metrics import WorkerMetrics
from worker_service.attention_names import AttentionBackendName
from worker_service.health import NoHealth, WorkerHealth
from stepahead.security import SchedulerClientConfig


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


def build_runner(config: WorkerConfig, group=None):
    """(runner, model dir); `group` (a `parallel.group.GroupSpec`): this rank's shard only."""
    if config.device == "sim":
        from worker_service.sim.build import build_sim_runner

        return build_sim_runner(config)
    import torch

    from stepahead.builtin_models import resolve_model
    from worker_service.kv_cache import block_bytes
    from worker_service.loader import parse_dtype
    from worker_service.model_config import ModelConfig
    from worker_service.model_runner import ModelRunner
    from worker_service.paged_attention import make_backend

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model(config.model, tokenizer=config.tokenizer)
    model_cfg = ModelConfig.from_dir(model_dir)
    dtype = config.dtype or "float32"
    check_weights_fit(model_dir, model_cfg, config, parse_dtype(dtype).itemsize)
    host_blocks = int(config.swap_space * 2**30) // block_bytes(model_cfg, config.block_size, parse_dtype(dtype))
    runner_class = ModelRunner
    if group is not None:
        from functools import partial

        from worker_service.parallel.runner import TPModelRunner

        runner_class = partial(TPModelRunner, rank=group.rank, size=group.size)
    runner = runner_class(
        model_dir,
        dtype=dtype,
        device=config.device,
        block_size=config.block_size,
        kv_cache_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_blocks=config.num_gpu_blocks_override,
        num_host_blocks=host_blocks,
        max_model_len=config.max_model_len,
        seed=config.seed,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_logprobs=config.max_logprobs,
        attention_backend=make_backend(config.attention_backend, torch.device(config.device), parse_dtype(dtype),
                                       config.block_size),
        speculative_config=parse_speculative_config(config.speculative_config),
        structured_outputs_cache_size=config.structured_outputs_cache_size,
    )
    return runner, model_dir


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


class HelloRefused(Exception):
    """The scheduler refused this worker's hello as invalid: the same worker would be refused
    again, so the daemon stops instead of re-attaching until start-up times out."""


def worker_info(config: WorkerConfig, runner, model_dir) -> WorkerInfo:
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
        max_logprobs=getattr(runner, "max_logprobs", 0),
        logprobs=getattr(runner, "computes_logprobs", True),  # the sim runner says False to both
        structured_outputs=getattr(runner, "supports_structured_outputs", True),
    )


class _Pipeline:
    """Plans in → launched on the stream's reader thread; results out on grpc's request
    thread, in plan order.

    Each step is launched as soon as its plan arrives, on the thread that read it (a
    placeholder decode reads the previous step's ids on the device). `requests()` is the
    request stream's iterator: grpc's own thread runs it, waits there for each launched
    step's sampled ids to reach the host (the one sync per step) and sends the result at
    once. Neither way has a hand-off to another thread of ours: on a loaded host each one
    is a wake-up the device would wait for (the scheduler plans the step after next only
    once this result is in).

    The outbox carries the request stream in order: the hello, launched steps, a fatal
    error, None (the end). Any exception (a plan the worker cannot run, an asynchronous
    device error surfacing in `wait()`) ends the session the same way: a `fatal_error`
    message tells the scheduler why (it fails the requests the worker held), the request
    stream closes (the scheduler then ends the plan stream), `on_fatal` cancels the call
    should the scheduler not do so within `FATAL_GRACE_S`, and `error` is set for the caller.
    """

    FATAL_GRACE_S = 30.0  # generous: under load a scheduler may take seconds to read the reason

    def __init__(self, runner, hello, log, metrics: WorkerMetrics | None = None, report: bool = True) -> None:
        self.runner, self.log = runner, log
        self.on_fatal = lambda: None  # set once the call exists (it cancels it)
        self.report = report  # False on tensor-parallel ranks other than 0: they send no results
        self.metrics = metrics or WorkerMetrics()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # WorkerMessages and launched steps; None ends
        self.outbox.put(hello)
        self.error: BaseException | None = None
        self._failed = threading.Event()
        self._fatal_timer: threading.Timer | None = None

    def submit(self, plan_msg, received: float) -> None:
        """Launch the plan's step (on the caller's thread); after a failure, plans are dropped."""
        if self._failed.is_set():
            return
        try:
            jitter.maybe_jitter()  # test-only delay (STEPAHEAD_TEST_JITTER_MS); a no-op when unset
            plan = codec.plan_from_proto(plan_msg)
            self.metrics.on_plan(plan)
            self.outbox.put(self.runner.launch(plan, received))
        except Exception as exc:  # reported to the scheduler; the session ends
            self._fail(exc, "launch")

    def requests(self):
        """The request stream: each message as it comes; a launched step's result once its ids
        are on the host (nothing after a failure but the fatal error)."""
        from stepahead.v1 import scheduler_pb2

        while (item := self.outbox.get()) is not None:
            if type(item) is scheduler_pb2.WorkerMessage:
                yield item
            elif not self._failed.is_set():
                try:
                    message = self._result_message(item)
                except Exception as exc:  # e.g. an asynchronous device error: reported, never a silent hang
                    self._fail(exc, "wait")
                    continue
                if message is not None:
                    yield message

    def _result_message(self, pending):
        """Wait for a launched step; its result message (None on ranks that do not report)."""
        from stepahead.v1 import scheduler_pb2

        result = pending.wait()
        for rid, reason in result.failed.items():
            self.log.warning("request_failed", request_id=rid, step_id=result.step_id, reason=reason)
        result = dataclasses.replace(result, timing=dataclasses.replace(result.timing, result_sent=time.time()))
        self.metrics.on_result(result)
        return scheduler_pb2.WorkerMessage(result=codec.result_to_proto(result)) if self.report else None

    def close(self) -> None:
        self.outbox.put(None)  # the request stream ends, whatever happened
        if self._fatal_timer is not None:
            self._fatal_timer.cancel()

    def _fail(self, exc: BaseException, where: str) -> None:
        """First failure wins: tell the scheduler, close the stream, stop the session."""
        if self._failed.is_set():
            return
        self._failed.set()
        self.error = exc
        self.log.error("step_failed", where=where, error=repr(exc)[:500], exc_info=exc)
        from stepahead.v1 import scheduler_pb2

        self.outbox.put(scheduler_pb2.WorkerMessage(fatal_error=f"{where}: {exc!r}"[:1000]))
        self.outbox.put(None)
        self._fatal_timer = threading.Timer(self.FATAL_GRACE_S, lambda: self.on_fatal())
        self._fatal_timer.daemon = True
        self._fatal_timer.start()


class _StopWatch:
    """Ends the current attach session when the daemon is told to stop: one thread for the
    daemon's whole life, not one per attach (re-attaching must not leak threads).

    The worker detaches cleanly (it closes its request stream; the scheduler then closes
    the plan stream); the call is cancelled only if that has not happened in `GRACE_S`.
    """

    GRACE_S = 2.0

    def __init__(self, stop: threading.Event, on_stop=lambda: None) -> None:
        self._lock = threading.Lock()
        self._session = None
        self._stopped = False
        self._on_stop = on_stop
        threading.Thread(target=self._watch, args=(stop,), name="stop-watch", daemon=True).start()

    def _watch(self, stop: threading.Event) -> None:
        stop.wait()
        self._on_stop()  # draining: not ready any more
        with self._lock:
            self._stopped = True
            if self._session is not None:
                self._detach(*self._session)

    def _detach(self, call, outbox: queue.SimpleQueue) -> None:
        outbox.put(None)
        timer = threading.Timer(self.GRACE_S, call.cancel)
        timer.daemon = True
        timer.start()

    def track(self, call, outbox: queue.SimpleQueue | None = None) -> None:
        with self._lock:
            self._session = (call, outbox) if call is not None else None
            if self._stopped and call is not None:
                self._detach(call, outbox)


def attach_once(channel, runner, info: WorkerInfo, watch: _StopWatch, log,
                metrics: WorkerMetrics | None = None, health: WorkerHealth | NoHealth = NoHealth()) -> None:
    """One attach session: hello, then execute plans until the stream ends. Health is
    SERVING from the scheduler's acceptance (initial metadata) until the stream ends."""
    from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

    hello = scheduler_pb2.WorkerMessage(hello=codec.worker_info_to_proto(info))
    pipeline = _Pipeline(runner, hello, log, metrics=metrics, report=info.tp_rank == 0)
    responses = scheduler_pb2_grpc.SchedulerStub(channel).AttachWorker(pipeline.requests())
    pipeline.on_fatal = responses.cancel
    watch.track(responses, pipeline.outbox)
    log.info("attached", worker_id=info.worker_id)
    try:
        if daemon.ATTACH_ACCEPTED in (responses.initial_metadata() or ()):  # blocks until accepted or refused
            health.attached()
        for msg in responses:
            pipeline.submit(msg.plan, time.time())
    except Exception:
        if pipeline.error is None:
            raise  # the stream broke (scheduler gone or refused us): the caller logs it
    finally:
        health.detached()
        watch.track(None)
        pipeline.close()
        responses.cancel()
    if pipeline.error is not None:
        raise pipeline.error


def serve(config: WorkerConfig, stop: threading.Event, log, health: WorkerHealth | NoHealth = NoHealth()) -> None:
    import grpc

    if config.tensor_parallel_size > 1:
        from worker_service.parallel.session import serve_group

        return serve_group(config, stop, log, health)
    runner, model_dir = build_runner(config)
    info = worker_info(config, runner, model_dir)
    log.info("model_loaded", **{k: v for k, v in info.__dict__.items() if k != "eos_token_ids"})
    log_kv_capacity(log, info)
    metrics = WorkerMetrics(REGISTRY)  # one per daemon: counters go on across re-attaches
    metrics.watch_grammars(runner)
    freeze_heap()  # the model, the KV cache and the imports live as long as the process
    watch = _StopWatch(stop, on_stop=health.stopping)
    backoff, failures = 0.05, 0
    while not stop.is_set():
        with config.scheduler_channel(config.scheduler) as channel:
            try:
                daemon.wait_channel_ready(channel, max(backoff, 1.0))
                backoff = 0.05
                attach_once(channel, runner, info, watch, log, metrics, health)
                failures = 0
            except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise HelloRefused(f"the scheduler at {config.scheduler} refused this worker: "
                                       f"{exc.details()}") from exc
                failures += 1
                if not stop.is_set():  # a scheduler restarting is normal; one gone for long is not
                    (log.warning if failures > 5 else log.info)(
                        "attach_failed", scheduler=config.scheduler, attempts=failures, error=repr(exc)[:300])
            except Exception as exc:  # a failed step: already reported to the scheduler; start clean
                log.warning("attach_session_failed", error=repr(exc)[:300])
        runner.reset()  # the scheduler forgot our requests; so do we
        stop.wait(backoff)  # reconnect backoff, interrupted by SIGTERM
        backoff = min(backoff * 2, config.reconnect_max_backoff_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, WorkerConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.from_args(WorkerConfig, args)
    log = logs.configure("worker", config.log_level)
    try:
        parse_speculative_config(config.speculative_config)
        GcPauses(REGISTRY, "stepahead:worker_gc_pause_seconds", log, config.gc_warning_threshold_secs)
    except (cfg.ConfigError, ValueError) as exc:
        log.error("bad_configuration", error=str(exc))
        return 2
    daemon.tune_gil()
    stop = daemon.install_stop_handlers()
    if config.metrics_port is not None:
        start_http_server(config.metrics_port, registry=REGISTRY)
    from worker_service.parallel.geometry import GeometryError

    try:  # up before the model loads: a probe sees NOT_SERVING, not a refused connection
        health = WorkerHealth(config.health_host, config.health_port, log) if config.health_port is not None \
            else NoHealth()
    except RuntimeError as exc:  # grpc cannot bind the port
        log.error("bad_configuration", error=f"--health-port {config.health_port}: {exc}")
        return 2
    if health.port is not None:
        log.info("health_listening", address=f"{config.health_host}:{health.port}")
    try:
        serve(config, stop, log, health)
    except GeometryError as exc:  # the model does not split over --tensor-parallel-size
        log.error("bad_tensor_parallel_geometry", error=str(exc))
        return 2
    except HelloRefused as exc:
        log.error("hello_refused", error=str(exc))
        return 2
    finally:
        health.close()
    return 0
