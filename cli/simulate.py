"""`stepahead simulate`: replay a request trace offline, on a virtual clock.

    stepahead simulate --dataset-path trace.jsonl --sim-profile h200 --model llama3-8b-sim \
        --scheduling-policy priority --result-filename sim.json

The real scheduler core (`scheduler_service.core.scheduler.Scheduler`, its clock injected) plans
steps; the sim worker's runner (`worker_service.sim`) applies them and prices them with the
roofline cost model. No processes, no sleeping: an hour of trace takes seconds. The
in-flight window is the engine's own `StepLoop` (`scheduler_service.window`: one step
ahead, deeper up to `--max-concurrent-batches` while the device waits for plans; 1 with
`--no-async-scheduling`) and the device runs one step at a time. The control plane is free
by default; `--sim-*-latency-ms` give it the four latencies of the real daemons
(`benchmarks/hops.py` measures them): a request reaches the scheduler `ingress` after its
arrival, a plan can start on the device `plan` after it was made, a result is committed
`result` after its step ended, and a token reaches its client `egress` after its commit.
Output: the same metric keys as `stepahead bench` (vLLM's), plus
`device_utilization`, per priority class summaries and every request's timeline; comparing
it with a real-time run of the sim-worker system shows what the control plane costs.

Every run ends: when the scheduler can plan nothing while requests remain, or when its
committed steps stop giving any request a token (`Scheduler.stall`: a preempt / readmit
cycle), the run stops with `SimulationStalled` naming the reason, instead of spinning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from cli import output_file
from cli.virtual_cluster import (ControlPlane, SimRequestLog, SimulationStalled, VirtualCluster,  # noqa: F401
                                 VirtualReplica)
from scheduler_service.core.config import SchedulingConfig
from stepahead import config as cfg
from stepahead.knobs import KVCacheConfig, SimDeviceConfig, SpeculativeFlag
from stepahead.plan import WorkerRole

SIMULATED_GROUPS = (SchedulingConfig, SpeculativeFlag)


@dataclass(frozen=True)
class SimulateConfig(SimDeviceConfig, KVCacheConfig):
    """`stepahead simulate`'s own flags; the scheduling flags are the scheduler daemon's groups."""

    dataset_path: str = cfg.field("", "trace file: Azure CSV or JSONL (see stepahead bench --dataset-name trace)")
    num_prompts: int | None = cfg.field(None, "replay only the trace's first N requests")
    trace_speedup: float = cfg.field(1.0, "divide the trace's inter-arrival times")
    model: str = cfg.field("llama3-8b-sim", "model directory or built-in name (config.json is read)")
    dtype: str | None = cfg.field(None, "weight dtype (default: the checkpoint's torch_dtype)")
    seed: int = cfg.field(0, "seed of the prompts' token ids (the same as stepahead bench's --seed)")
    sim_ingress_latency_ms: float = cfg.field(0.0, "client send -> the scheduler plans with the request")
    sim_plan_latency_ms: float = cfg.field(0.0, "plan made -> the device can start it (send, wire, worker prep)")
    sim_result_latency_ms: float = cfg.field(0.0, "step end on the device -> its result committed")
    sim_egress_latency_ms: float = cfg.field(0.0, "commit -> the token reaches its client")
    result_filename: str = cfg.field("", "write the JSON result here")
    replicas: int = cfg.field(1, "replicas serving both prefill and decode (data parallel), each with its own "
                                 "scheduler core, KV pool and device")
    prefill_replicas: int = cfg.field(0, "disaggregated: replicas that prefill new prompts (with --decode-replicas)")
    decode_replicas: int = cfg.field(0, "disaggregated: replicas that decode what the prefill replicas handed off")
    kv_link: str = cfg.field("ib", "the link KV blocks cross from a prefill to a decode replica: nvlink, ib, "
                                   "pcie or a JSON file (name, bandwidth in bytes/s, latency_s)")

    def roles(self) -> list[WorkerRole]:
        """Every replica's role: `replicas` BOTH, or the prefill then the decode replicas."""
        p, d = self.prefill_replicas, self.decode_replicas
        if p or d:
            if p < 1 or d < 1 or self.replicas != 1:
                raise SystemExit("stepahead simulate: --prefill-replicas and --decode-replicas go together (each "
                                 f">= 1) and replace --replicas; got {p}, {d} and --replicas {self.replicas}")
            return [WorkerRole.PREFILL] * p + [WorkerRole.DECODE] * d
        if self.replicas < 1:
            raise SystemExit(f"stepahead simulate: --replicas must be >= 1, got {self.replicas}")
        return [WorkerRole.BOTH] * self.replicas


def build(config: SimulateConfig, sched_flags, role: WorkerRole = WorkerRole.BOTH, worker_id: str = "simulate"):
    """(runner, scheduler config, worker info) of one replica, from the simulator's and the
    scheduler daemon's flags."""
    from model_zoo.builtin_models import resolve_model
    from stepahead.plan import WorkerInfo
    from worker_service.sim.build import checkpoint_dtype
    from worker_service.sim.profiles import load_profile
    from worker_service.sim.runner import SimRunner

    model_dir = resolve_model(config.model)
    runner = SimRunner(model_dir, load_profile(config.sim_profile), dtype=config.dtype or checkpoint_dtype(model_dir),
                       num_devices=config.sim_num_devices, block_size=config.block_size,
                       num_blocks=config.num_gpu_blocks_override, memory_utilization=config.gpu_memory_utilization,
                       swap_space_bytes=config.swap_space * 2**30,
                       offload_space_bytes=config.kv_offloading_size * 2**30, eos_probability=0.0)
    info = WorkerInfo(worker_id, model_dir.name, runner.model_type, runner.dtype, runner.device, runner.block_size,
                      runner.num_blocks, runner.num_host_blocks, runner.max_model_len, runner.vocab_size,
                      tuple(runner.eos_token_ids), num_offload_blocks=runner.num_offload_blocks, role=role)
    return runner, sched_flags.core_config(info), info


class VirtualSystem(VirtualCluster):
    """One replica (`VirtualCluster` with one BOTH replica): scheduler core + sim runner on a
    virtual clock: arrivals, plans, device steps.

    The window is the daemon's own: a `StepLoop` plans while it has room (on a commit, or
    when work arrives) and commits results in plan order, judging each step's lateness from
    its timing as the engine does. The runner here is a virtual-clock worker: each plan runs
    on the device as soon as it arrives and the device is free, and its result reaches the
    scheduler `ControlPlane.result` after the step ends.
    """

    def __init__(self, runner, sched_config, control: ControlPlane = ControlPlane()) -> None:
        super().__init__([("simulate", runner, sched_config, WorkerRole.BOTH)], control)

    @property
    def replica(self) -> VirtualReplica:
        return self.replicas[0]

    @property
    def scheduler(self):
        return self.replica.scheduler

    @property
    def runner(self):
        return self.replica.runner

    @property
    def loop(self):
        return self.replica.loop


def build_cluster(config: SimulateConfig, sched_flags) -> tuple[VirtualCluster, object]:
    """The virtual cluster of `config.roles()` (one replica: a `VirtualSystem`), and the first
    replica's worker info."""
    roles = config.roles()
    control = ControlPlane.of(config)
    if roles == [WorkerRole.BOTH]:
        runner, sched_config, info = build(config, sched_flags)
        return VirtualSystem(runner, sched_config, control), info
    from worker_service.sim.profiles import load_link_profile

    replicas, infos = [], []
    counts = {role: 0 for role in WorkerRole}
    for role in roles:
        name = f"{role.value}-{counts[role]}"
        counts[role] += 1
        runner, sched_config, info = build(config, sched_flags, role, worker_id=name)
        replicas.append((name, runner, sched_config, role))
        infos.append(info)
    link = load_link_profile(config.kv_link) if WorkerRole.PREFILL in roles else None
    return VirtualCluster(replicas, control, link, replicas[0][1].kv_bytes_per_block), infos[0]


def simulate(config: SimulateConfig, sched_flags) -> dict:
    from scheduler_service.core.request import Request
    from cli.datasets import load_trace, trace_prompts
    from stepahead.plan import SamplingParams

    system, info = build_cluster(config, sched_flags)
    runner = system.replicas[0].runner
    trace = load_trace(config.dataset_path, config.num_prompts, config.trace_speedup)
    prompts = trace_prompts(trace, runner.vocab_size, config.seed)
    arrivals = []
    for i, (r, prompt) in enumerate(zip(trace, prompts)):
        sampling = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        log = SimRequestLog(i, r.arrival_s, r.prompt_len, r.priority, r.output_len)
        arrivals.append((r.arrival_s, Request(f"req-{i}", prompt, sampling, priority=r.priority), log))
    system.run(arrivals)
    for _, request, log in arrivals:
        log.num_preemptions = system.requests.get(request.request_id, request).num_preemptions  # the last core's
    logs = [log for _, _, log in arrivals]
    return summarize(logs, system, info, config)


def summarize(logs: list[SimRequestLog], system: VirtualCluster, info, config: SimulateConfig) -> dict:
    """The run's metrics; `device_utilization` is the replicas' mean, `replicas` each one's."""
    failed = [log for log in logs if log.finish_reason.startswith("REJECTED")]
    logs = [log for log in logs if not log.finish_reason.startswith("REJECTED")]
    duration = max(log.finish for log in logs) - min(log.arrival for log in logs) if logs else 0.0
    duration = duration or 1e-9
    out = sum(len(log.token_times) for log in logs)
    result = {
        "label": "simulate", "model": info.model_name, "device": info.device, "duration": duration,
        "completed": len(logs), "failed": len(failed), "errors": sorted({f.finish_reason for f in failed})[:5],
        "total_input_tokens": sum(log.prompt_len for log in logs), "total_output_tokens": out,
        "request_throughput": len(logs) / duration, "output_throughput": out / duration,
        "total_token_throughput": (out + sum(log.prompt_len for log in logs)) / duration,
        **request_latencies(logs),
        "device_utilization": system.busy / duration / len(system.replicas), "device_busy_s": system.busy,
        "num_steps": system.num_steps,
        "num_preemptions": sum(r.scheduler.stats().num_preemptions for r in system.replicas),
        "max_preemptions_per_request": max((log.num_preemptions for log in logs), default=0),
        "by_priority": {str(p): request_latencies([log for log in logs if log.priority == p])
                        for p in sorted({log.priority for log in logs})},
        "config": dataclasses.asdict(config),
    }
    if len(system.replicas) > 1:
        result["replicas"] = [{"name": r.name, "role": r.role.value, "device_utilization": r.busy / duration,
                               "num_steps": r.num_steps, "num_preemptions": r.scheduler.stats().num_preemptions,
                               "num_requests": sum(log.replica == r.name for log in logs),
                               "num_handed_in": sum(log.decode_replica == r.name for log in logs)}
                              for r in system.replicas]
    if system.transfers:
        result["kv_transfers"] = transfer_stats(system)
    result["requests"] = [dataclasses.asdict(log) for log in sorted([*logs, *failed], key=lambda g: g.index)]
    return result


def transfer_stats(system: VirtualCluster) -> dict:
    """The hand-offs' KV transfers: how many, their bytes, and their time on the link and waiting for it."""
    from cli.bench import latency_stats

    done = [t for t in system.transfers if t.end is not None]
    return {"num_transfers": len(system.transfers), "num_completed": len(done), "link": system.link.name,
            "num_without_load": sum(t.ready is None for t in system.transfers),  # all in the destination's cache
            "bytes": sum(t.nbytes for t in done), "blocks": sum(t.num_blocks for t in done),
            **latency_stats("link", [(t.end - t.start) * 1e3 for t in done]),
            **latency_stats("link_wait", [(t.start - t.ready) * 1e3 for t in done])}


def request_latencies(logs: list[SimRequestLog]) -> dict:
    from cli.bench import latency_stats

    ttft = [(log.token_times[0] - log.arrival) * 1e3 for log in logs if log.token_times]
    tpot = [(log.token_times[-1] - log.token_times[0]) / (len(log.token_times) - 1) * 1e3
            for log in logs if len(log.token_times) > 1]
    itl = [(b - a) * 1e3 for log in logs for a, b in zip(log.token_times, log.token_times[1:])]
    e2el = [(log.finish - log.arrival) * 1e3 for log in logs if log.finish is not None]
    queue = [(log.first_scheduled - log.arrival) * 1e3 for log in logs if log.first_scheduled is not None]
    return {**latency_stats("ttft", ttft), **latency_stats("tpot", tpot), **latency_stats("itl", itl),
            **latency_stats("e2el", e2el), "max_queue_wait_ms": max(queue, default=0.0), "num_requests": len(logs)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, SimulateConfig)
    for group in SIMULATED_GROUPS:  # the core's knobs; the daemon's listening, routing and timeouts do not apply
        cfg.add_arguments(parser, group)


def run(args: argparse.Namespace) -> int:
    from scheduler_service.server import SchedulerDaemonConfig
    from worker_service.sim.profiles import load_link_profile, load_profile

    config = cfg.from_args(SimulateConfig, args)
    if not config.dataset_path:
        raise SystemExit("stepahead simulate: --dataset-path is required")
    load_profile(config.sim_profile)  # a bad name or file fails now (a ProfileError: one line)
    load_link_profile(config.kv_link)
    result_file = output_file(config.result_filename, "--result-filename") if config.result_filename else None
    result = simulate(config, cfg.from_args(SchedulerDaemonConfig, args))
    if result_file is not None:
        result_file.write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("requests", "config")}, indent=2))
    return 0
