"""The attach loop of a worker started with `--tensor-parallel-size k` (k > 1).

    join (JoinGroup: rank, rank 0's address) → init the process group → load this rank's
    shard → attach with the group in the hello → execute plans → on any end: tear down
    the process group, drop the shard, join again.

The shard is loaded after the join because the rank decides which slice to read. Any end
of a session (the scheduler closed the group because another rank died, a collective
timed out, the scheduler went away) tears the process group down before joining again,
so the next group starts clean, possibly with another rank.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import threading

from prometheus_client import REGISTRY

from stepahead.ports import free_port
from worker_service.attach import StopWatch, attach_once, reconnect
from worker_service.config import WorkerConfig
from worker_service.health import NoHealth, WorkerHealth
from worker_service.metrics import WorkerMetrics
from worker_service.model_config import ModelConfig
from worker_service.parallel.geometry import ShardGeometry
from worker_service.parallel.group import GroupSpec, default_backend, destroy_group, init_group
from worker_service.runners import build_runner, worker_info

JOIN_POLL_S = 0.2  # how often a pending join looks at the stop flag


def check_geometry(config: WorkerConfig) -> None:
    """Before joining: a model that does not split k ways is refused (GeometryError names the dimension)."""
    from model_zoo.builtin_models import resolve_model

    if config.device == "sim":
        raise SystemExit("stepahead worker: --device sim models tensor parallelism with --sim-num-devices; "
                         "--tensor-parallel-size must be 1")
    ShardGeometry.of(ModelConfig.from_dir(resolve_model(config.model)), 0, config.tensor_parallel_size,
                     config.enable_expert_parallel)


def serve_group(config: WorkerConfig, stop: threading.Event, log, health: WorkerHealth | NoHealth = NoHealth()) -> None:
    check_geometry(config)
    metrics = WorkerMetrics(REGISTRY)  # one per daemon: counters go on across groups
    watch = StopWatch(stop, on_stop=health.stopping)

    def session(channel) -> bool:
        spec = join(channel, config, stop)
        if spec is None:  # told to stop while waiting for a group
            return False
        run_group(channel, config, spec, watch, log, metrics, health)
        return True

    def end_session() -> None:  # any end tears the group down; the next one starts clean
        destroy_group()
        gc.collect()  # the shard and its KV cache go before the next one is loaded

    reconnect(config, stop, log, session, on_session_end=end_session, failed_event="group_session_failed",
              refusal_is_final=False)


def join(channel, config: WorkerConfig, stop: threading.Event) -> GroupSpec | None:
    """Ask the scheduler for a place in a group; None when told to stop meanwhile."""
    from stepahead.v1 import scheduler_pb2, scheduler_pb2_grpc

    request = scheduler_pb2.JoinGroupRequest(
        worker_id=f"{socket.gethostname()}:{os.getpid()}", tensor_parallel_size=config.tensor_parallel_size,
        rendezvous_host=config.advertise_host or "", rendezvous_port=free_port(""))
    call = scheduler_pb2_grpc.SchedulerStub(channel).JoinGroup.future(request)
    while not call.done():
        if stop.wait(JOIN_POLL_S):
            call.cancel()
            return None
    reply = call.result()
    return GroupSpec(reply.group_id, reply.rank, reply.world_size, reply.master_addr, reply.master_port,
                     config.distributed_backend or default_backend(config.device), config.distributed_timeout)


def run_group(channel, config: WorkerConfig, spec: GroupSpec, watch, log, metrics,
              health: WorkerHealth | NoHealth = NoHealth()) -> None:
    log.info("group_rendezvous", group_id=spec.group_id, rank=spec.rank, world_size=spec.size,
             master=f"{spec.master_addr}:{spec.master_port}", backend=spec.backend)
    init_group(spec)
    runner, model_dir = build_runner(config, spec)
    metrics.watch_grammars(runner)
    info = dataclasses.replace(worker_info(config, runner, model_dir), group_id=spec.group_id,
                               tp_rank=spec.rank, tp_size=spec.size)
    log.info("shard_loaded", group_id=spec.group_id, rank=spec.rank, num_device_blocks=info.num_device_blocks)
    attach_once(channel, runner, info, watch, log, metrics, health)
