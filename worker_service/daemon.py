"""The worker daemon: loads a model, dials the scheduler, executes plans in order.

    stepahead worker --scheduler 127.0.0.1:50051 --model tiny

The worker is a gRPC *client*: it opens AttachWorker on the scheduler, says hello with its
model and KV geometry, then executes each plan it receives and answers with the result
on the same stream. When the stream breaks it forgets every request and dials again with
exponential backoff, so a restarted scheduler gets a clean worker. The flags are
`config.WorkerConfig`; the stream and the reconnect loop are `attach.py`; the runner is
built by `runners.build_runner`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import threading

from prometheus_client import REGISTRY, start_http_server

from stepahead import config as cfg
from stepahead import daemon, logs
from stepahead.heap import GcPauses, freeze_heap
from stepahead.plan import WorkerRole
from stepahead.speculative import parse_speculative_config
from worker_service.attach import HelloRefused, StopWatch, attach_once, reconnect
from worker_service.config import WorkerConfig
from worker_service.health import NoHealth, WorkerHealth
from worker_service.kv_loads import KVLoader
from worker_service.kv_transfer import KVTransferServer
from worker_service.metrics import WorkerMetrics
from worker_service.runners import build_runner, check_device_flags, log_kv_capacity, worker_info

__all__ = ["WorkerConfig", "add_arguments", "run", "serve"]


def serve(config: WorkerConfig, stop: threading.Event, log, health: WorkerHealth | NoHealth = NoHealth(),
          kv_server: KVTransferServer | None = None, metrics: WorkerMetrics | None = None) -> None:
    """Load the model and stay attached. `kv_server` (a prefill worker's, bound at start-up)
    serves this runner's blocks and is announced in the hello."""
    if config.tensor_parallel_size > 1:
        from worker_service.parallel.session import serve_group

        return serve_group(config, stop, log, health)
    runner, model_dir = build_runner(config)
    info = worker_info(config, runner, model_dir)
    if kv_server is not None:
        kv_server.serve(runner)
        info = dataclasses.replace(info, kv_transfer_address=kv_server.address,
                                   kv_transfer_instance=kv_server.instance)
    log.info("model_loaded", **{k: v.value if isinstance(v, enum.Enum) else v for k, v in info.__dict__.items()
                                if k != "eos_token_ids"})
    log_kv_capacity(log, info)
    metrics = metrics or WorkerMetrics(REGISTRY)  # one per daemon: counters go on across re-attaches
    metrics.watch_grammars(runner)
    freeze_heap()  # the model, the KV cache and the imports live as long as the process
    watch = StopWatch(stop, on_stop=health.stopping)

    def new_loader(report) -> KVLoader:  # one per attach session
        return KVLoader(runner, config.scheduler_channel, config.kv_transfer_timeout, report, log,
                        on_end=metrics.on_kv_load)

    def session(channel) -> bool:
        attach_once(channel, runner, info, watch, log, metrics, health, new_loader)
        return True

    # the scheduler forgot our requests when the session ended; so do we
    reconnect(config, stop, log, session, on_session_end=runner.reset)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, WorkerConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.from_args(WorkerConfig, args)
    log = logs.configure("worker", config.log_level)
    try:
        parse_speculative_config(config.speculative_config)
        if config.role is not WorkerRole.BOTH and config.tensor_parallel_size > 1:
            raise cfg.ConfigError(f"--role {config.role.value}: disaggregated prefill/decode runs single-worker "
                                  f"replicas; it does not combine with --tensor-parallel-size "
                                  f"{config.tensor_parallel_size}")
        if config.enable_expert_parallel and config.tensor_parallel_size < 2:
            raise cfg.ConfigError("--enable-expert-parallel divides the experts over the tensor-parallel ranks: "
                                  "it needs --tensor-parallel-size >= 2")
        check_device_flags(config)
        if config.device == "sim":
            from worker_service.sim.profiles import load_link_profile, load_profile

            load_profile(config.sim_profile)
            load_link_profile(config.sim_kv_link)
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
    kv_server = metrics = None
    if config.serves_kv_transfer:  # bound before the model loads: a bad port fails at once
        metrics = WorkerMetrics(REGISTRY)
        try:
            kv_server = KVTransferServer(config, log,
                                         on_refused=lambda method: metrics.kv_transfer_refused.labels(method).inc())
        except cfg.ConfigError as exc:
            log.error("bad_configuration", error=str(exc))
            health.close()
            return 2
        log.info("kv_transfer_listening", address=kv_server.address)
        if (config.kv_transfer_advertise_host or config.kv_transfer_host) in ("0.0.0.0", "::", "[::]"):
            log.warning("kv_transfer_address_unreachable", address=kv_server.address,
                        hint="decode workers cannot dial an unspecified address: set --kv-transfer-advertise-host")
    try:
        serve(config, stop, log, health, kv_server, metrics)
    except GeometryError as exc:  # the model does not split over --tensor-parallel-size
        log.error("bad_tensor_parallel_geometry", error=str(exc))
        return 2
    except cfg.ConfigError as exc:  # found while loading (a KV cache budget that holds no block)
        log.error("bad_configuration", error=str(exc))
        return 2
    except HelloRefused as exc:
        log.error("hello_refused", error=str(exc))
        return 2
    finally:
        health.close()
        if kv_server is not None:
            kv_server.close()
    return 0
