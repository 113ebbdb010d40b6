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
import collections
import dataclasses
import heapq
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from scheduler_service.core.config import SchedulingConfig
from stepahead import config as cfg
from stepahead.knobs import KVCacheConfig, SimDeviceConfig, SpeculativeFlag

SIMULATED_GROUPS = (SchedulingConfig, SpeculativeFlag)


class SimulationStalled(RuntimeError):
    """The simulated scheduler stopped making progress; the message says why."""


@dataclass
class SimRequestLog:
    index: int
    arrival: float
    prompt_len: int
    priority: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    finish: float | None = None
    finish_reason: str = ""
    num_preemptions: int = 0


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


def build(config: SimulateConfig, sched_flags):
    """(runner, scheduler config) from the simulator's and the scheduler daemon's flags."""
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
    info = WorkerInfo("simulate", model_dir.name, runner.model_type, runner.dtype, runner.device, runner.block_size,
                      runner.num_blocks, runner.num_host_blocks, runner.max_model_len, runner.vocab_size,
                      tuple(runner.eos_token_ids), num_offload_blocks=runner.num_offload_blocks)
    return runner, sched_flags.core_config(info), info


@dataclass(frozen=True)
class ControlPlane:
    """The real daemons' latencies, in seconds (all 0: a free control plane)."""

    ingress: float = 0.0  # client send -> visible to the scheduler
    plan: float = 0.0  # plan made -> the device may start it
    result: float = 0.0  # step end -> result committed (the window frees, the next plan is made)
    egress: float = 0.0  # commit -> client

    @classmethod
    def of(cls, config: SimulateConfig) -> ControlPlane:
        values = (config.sim_ingress_latency_ms, config.sim_plan_latency_ms, config.sim_result_latency_ms,
                  config.sim_egress_latency_ms)
        if not all(v >= 0 for v in values):  # also refuses NaN
            raise SystemExit(f"--sim-*-latency-ms must be >= 0, got {values}")
        return cls(*(v / 1e3 for v in values))


class VirtualSystem:
    """Scheduler core + sim runner on one virtual clock: arrivals, plans, device steps.

    The window is the daemon's own: a `StepLoop` plans while it has room (on a commit, or
    when work arrives) and commits results in plan order, judging each step's lateness from
    its timing as the engine does. The runner here is a virtual-clock worker: each plan runs
    on the device as soon as it arrives and the device is free, and its result reaches the
    scheduler `ControlPlane.result` after the step ends.
    """

    def __init__(self, runner, sched_config, control: ControlPlane = ControlPlane()) -> None:
        from scheduler_service.core.scheduler import Scheduler
        from scheduler_service.step_loop import StepLoop

        self.control = control
        self.now = 0.0
        self.runner = runner
        self.scheduler = Scheduler(sched_config, clock=lambda: self.now)
        self.loop = StepLoop(self.scheduler)
        self._after_commit = False  # the next pump follows a commit (the window's lateness signal)
        self.device: collections.deque = collections.deque()  # (result, when it reaches the scheduler), in plan order
        self.device_free = 0.0
        self.busy = 0.0
        self.num_steps = 0
        self.logs: dict[str, SimRequestLog] = {}  # request id -> its log, once admitted
        self.requests: dict[str, object] = {}  # request id -> the Request, once admitted
        self._follow_up = None
        self._pending: list = []  # heap of (arrival at the scheduler, sequence number, Request, log)
        self._arrivals = itertools.count()  # the sequence numbers: equal times keep their order

    def run(self, arrivals: list[tuple[float, object, SimRequestLog]], follow_up=None) -> None:
        """arrivals: (time, Request, log); fills each log. `follow_up(request, log)`, called as
        a request finishes (closed loop: a conversation's next turn), returns the next
        (time, Request, log) to arrive, or None."""
        from scheduler_service.core.scheduler import RequestRejected

        logs, pending, self._follow_up = self.logs, self._pending, follow_up
        for t, request, log in arrivals:
            self._arrive(t, request, log)
        while pending or self.device or self.scheduler.has_unfinished_requests():
            while pending and pending[0][0] <= self.now:
                _, _, request, log = heapq.heappop(pending)
                try:
                    self.scheduler.add_request(request)
                except RequestRejected as exc:  # e.g. longer than the model or the KV pool
                    log.finish, log.finish_reason = self.now, f"REJECTED: {exc}"
                    continue
                logs[request.request_id] = log
                self.requests[request.request_id] = request
            self._pump()
            times = ([self.device[0][1]] if self.device else []) + ([pending[0][0]] if pending else [])
            if not times:
                if not self.scheduler.has_unfinished_requests():
                    return  # the last arrivals were rejected
                raise SimulationStalled(f"simulation stuck at t={self.now}: nothing to plan, "
                                        f"{self.scheduler.stats()}")
            self.now = max(self.now, min(times))
            if self.device and self.device[0][1] <= self.now:
                self._commit()
                stall = self.scheduler.stall()
                if stall is not None:
                    raise SimulationStalled(f"simulation livelocked at t={self.now:.3f} s: {stall}")

    def _pump(self) -> None:
        from stepahead.plan import StepResult, WorkerTiming

        on_commit, self._after_commit = self._after_commit, False
        while (plan := self.loop.plan_next(on_commit)) is not None:
            for r in plan.new_requests:  # the queue wait ends when a plan first takes the request
                log = self.logs[r.request_id]
                log.first_scheduled = self.now if log.first_scheduled is None else log.first_scheduled
            sampled, seconds, failed = self.runner.apply(plan)
            start = max(self.now + self.control.plan, self.device_free)
            self.device_free = start + seconds
            self.busy += seconds
            result = StepResult(plan.step_id, sampled, failed=failed, speculation=self.runner.last_speculation,
                                timing=WorkerTiming(forward_start=start, forward_end=self.device_free))
            self.device.append((result, self.device_free + self.control.result))
        for request_id, refusal in self.scheduler.take_shed():  # admission control refused it in the queue
            log = self.logs[request_id]
            log.finish, log.finish_reason = self.now + self.control.egress, f"REJECTED: {refusal}"

    def _commit(self) -> None:
        result, _ = self.device.popleft()
        _, events = self.loop.commit(result)
        self._after_commit = True
        self.num_steps += 1
        for event in events:
            log, seen = self.logs[event.request_id], self.now + self.control.egress
            log.token_times += [seen] * len(event.new_token_ids)
            if event.finish_reason is not None:
                log.finish, log.finish_reason = seen, event.finish_reason.name
                nxt = self._follow_up and self._follow_up(self.requests[event.request_id], log)
                if nxt:
                    self._arrive(*nxt)

    def _arrive(self, t: float, request, log: SimRequestLog) -> None:
        heapq.heappush(self._pending, (t + self.control.ingress, next(self._arrivals), request, log))


def simulate(config: SimulateConfig, sched_flags) -> dict:
    from scheduler_service.core.request import Request
    from cli.datasets import load_trace, trace_prompts
    from stepahead.plan import SamplingParams

    runner, sched_config, info = build(config, sched_flags)
    trace = load_trace(config.dataset_path, config.num_prompts, config.trace_speedup)
    prompts = trace_prompts(trace, runner.vocab_size, config.seed)
    arrivals = []
    for i, (r, prompt) in enumerate(zip(trace, prompts)):
        sampling = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        log = SimRequestLog(i, r.arrival_s, r.prompt_len, r.priority, r.output_len)
        arrivals.append((r.arrival_s, Request(f"req-{i}", prompt, sampling, priority=r.priority), log))
    system = VirtualSystem(runner, sched_config, ControlPlane.of(config))
    system.run(arrivals)
    for _, request, log in arrivals:
        log.num_preemptions = request.num_preemptions
    logs = [log for _, _, log in arrivals]
    return summarize(logs, system, info, config)


def summarize(logs: list[SimRequestLog], system: VirtualSystem, info, config: SimulateConfig) -> dict:
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
        "device_utilization": system.busy / duration, "device_busy_s": system.busy, "num_steps": system.num_steps,
        "num_preemptions": system.scheduler.stats().num_preemptions,
        "max_preemptions_per_request": max((log.num_preemptions for log in logs), default=0),
        "by_priority": {str(p): request_latencies([log for log in logs if log.priority == p])
                        for p in sorted({log.priority for log in logs})},
        "config": dataclasses.asdict(config),
    }
    result["requests"] = [dataclasses.asdict(log) for log in sorted([*logs, *failed], key=lambda g: g.index)]
    return result


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

    config = cfg.from_args(SimulateConfig, args)
    if not config.dataset_path:
        raise SystemExit("stepahead simulate: --dataset-path is required")
    result = simulate(config, cfg.from_args(SchedulerDaemonConfig, args))
    if config.result_filename:
        Path(config.result_filename).parent.mkdir(parents=True, exist_ok=True)
        Path(config.result_filename).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("requests", "config")}, indent=2))
    return 0
