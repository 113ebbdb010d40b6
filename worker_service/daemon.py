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

from stepahead import codec, daemon, logs
from stepahead import config as cfg
from stepahead.plan import WorkerInfo, WorkerTiming


@dataclass(frozen=True)
class WorkerConfig:
    scheduler: str = cfg.field("127.0.0.1:50051", "scheduler address to attach to")
    model: str = cfg.field("tiny", "model directory, or a built-in model name (tiny, 100m)")
    served_model_name: str | None = cfg.field(None, "name clients use (default: the model's directory name)")
    dtype: str = cfg.field("float32", "weight dtype: float32, bfloat16, float16")
    device: str = cfg.field("cpu", "torch device: cpu, cuda, cuda:1")
    block_size: int = cfg.field(16, "tokens per KV block")
    kv_cache_memory_bytes: int | None = cfg.field(None, "KV cache size in bytes (CPU default 512 MiB)")
    gpu_memory_utilization: float = cfg.field(0.9, "fraction of free CUDA memory for the KV cache")
    num_gpu_blocks_override: int | None = cfg.field(None, "exact number of device KV blocks (tests)")
    swap_space: float = cfg.field(1.0, "host memory for swapped-out KV blocks, GiB")
    max_model_len: int | None = cfg.field(None, "maximum prompt + output tokens (default: the model's)")
    seed: int = cfg.field(0, "seed of unseeded sampling")
    reconnect_max_backoff_s: float = cfg.field(5.0, "longest wait between attach attempts")
    log_level: str = cfg.field("info", "log level")


def build_runner(config: WorkerConfig):
    from stepahead.builtin_models import resolve_model
    from worker_service.kv_cache import block_bytes
    from worker_service.loader import parse_dtype
    from worker_service.model_config import ModelConfig
    from worker_service.model_runner import ModelRunner

    model_dir = resolve_model(config.model)
    model_cfg = ModelConfig.from_dir(model_dir)
    host_blocks = int(config.swap_space * 2**30) // block_bytes(model_cfg, config.block_size, parse_dtype(config.dtype))
    runner = ModelRunner(
        model_dir,
        dtype=config.dtype,
        device=config.device,
        block_size=config.block_size,
        kv_cache_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_blocks=config.num_gpu_blocks_override,
        num_host_blocks=host_blocks,
        max_model_len=config.max_model_len,
        seed=config.seed,
    )
    return runner, model_dir


def worker_info(config: WorkerConfig, runner, model_dir) -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"{socket.gethostname()}:{os.getpid()}",
        model_name=config.served_model_name or model_dir.name,
        model_type=runner.model_type,
        dtype=config.dtype,
        device=str(runner.device),
        block_size=runner.block_size,
        num_device_blocks=runner.num_blocks,
        num_host_blocks=runner.num_host_blocks,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=tuple(runner.eos_token_ids),
    )


def attach_once(channel, runner, info: WorkerInfo, stop: threading.Event, log) -> None:
    """One attach session: hello, then execute plans until the stream ends."""
    from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

    outbox: queue.Queue = queue.Queue()
    outbox.put(scheduler_pb2.WorkerMessage(hello=codec.worker_info_to_proto(info)))
    responses = scheduler_pb2_grpc.SchedulerStub(channel).AttachWorker(iter(outbox.get, None))
    stop_watch = threading.Thread(target=lambda: (stop.wait(), responses.cancel()), daemon=True)
    stop_watch.start()
    log.info("attached", worker_id=info.worker_id)
    try:
        for msg in responses:
            received = time.time()
            result = runner.execute(codec.plan_from_proto(msg.plan))
            done = time.time()
            timing = WorkerTiming(received, received, received, done, time.time())
            result = dataclasses.replace(result, timing=timing)
            outbox.put(scheduler_pb2.WorkerMessage(result=codec.result_to_proto(result)))
    finally:
        outbox.put(None)


def serve(config: WorkerConfig, stop: threading.Event, log) -> None:
    import grpc

    runner, model_dir = build_runner(config)
    info = worker_info(config, runner, model_dir)
    log.info("model_loaded", **{k: v for k, v in info.__dict__.items() if k != "eos_token_ids"})
    backoff = 0.05
    while not stop.is_set():
        with grpc.insecure_channel(config.scheduler) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=max(backoff, 1.0))
                backoff = 0.05
                attach_once(channel, runner, info, stop, log)
            except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                if not stop.is_set():
                    log.warning("attach_failed", scheduler=config.scheduler, error=repr(exc)[:200])
        runner.reset()  # the scheduler forgot our requests; so do we
        stop.wait(backoff)  # reconnect backoff, interrupted by SIGTERM
        backoff = min(backoff * 2, config.reconnect_max_backoff_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, WorkerConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.from_args(WorkerConfig, args)
    log = logs.configure("worker", config.log_level)
    stop = daemon.install_stop_handlers()
    serve(config, stop, log)
    return 0
