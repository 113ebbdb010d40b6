"""`stepahead simulate`'s virtual cluster: replicas on one virtual clock, with their KV transfers.

Each replica is what `stepahead simulate` ran alone before: the real scheduler core
(`scheduler_service.core.scheduler.Scheduler`, its clock injected), the engine's `StepLoop`
window, and a sim runner (`worker_service.sim`) that prices each plan with the roofline cost
model; its device runs one step at a time. The cluster owns the clock and orders the events of
all replicas, in one loop: requests reach the scheduler (and are routed), finished KV transfers
are reported, every replica plans while its window has room, and the earliest step result is
committed. With one replica this is, event for event, the single-replica simulator.

Routing, as the scheduler daemon does it: a new request goes to the least-loaded replica
(fewest unfinished requests; ties to the first) among those that take new prompts (roles BOTH
and PREFILL; DECODE replicas only when no replica prefills). Disaggregation (`WorkerRole`):
after each commit on a PREFILL replica its hand-offs (`Scheduler.take_handoffs`, a request
whose first token just committed) go to the least-loaded DECODE replica
(`Scheduler.add_transferred`). A plan of that replica carrying a `KVLoad` starts the transfer
when the plan starts on its device; the transfer takes `LinkProfile.transfer_seconds` of the
blocks' bytes on the replica's inbound link (one transfer at a time per destination, in the
order their plans started; the link is not the device, so it overlaps the replica's steps),
and its end is reported `ControlPlane.result` later (`kv_loaded` on the decode core). Once a
decode core no longer needs a transfer's source blocks (`Scheduler.take_released_sources`:
loaded, all in its prefix cache, or the request ended), `release_handoff` frees them on the
prefill core, as the engine does (`scheduler_service/transfers.py`).

Every run ends: when no replica can plan anything while requests remain, or when a core's
committed steps stop giving any request a token (`Scheduler.stall`), the run stops with
`SimulationStalled` naming the reason.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass, field

from stepahead.plan import KVLoaded, StepResult, WorkerRole, WorkerTiming


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
    replica: str = ""  # the replica the request was routed to (its prefill replica when disaggregated)
    decode_replica: str = ""  # the replica it was handed off to ("" : none)


@dataclass(frozen=True)
class ControlPlane:
    """The real daemons' latencies, in seconds (all 0: a free control plane)."""

    ingress: float = 0.0  # client send -> visible to the scheduler
    plan: float = 0.0  # plan made -> the device may start it
    result: float = 0.0  # step end (or KV load end) -> reported to the scheduler
    egress: float = 0.0  # commit -> client

    @classmethod
    def of(cls, config) -> ControlPlane:
        """From `stepahead simulate`'s `--sim-*-latency-ms` flags."""
        values = (config.sim_ingress_latency_ms, config.sim_plan_latency_ms, config.sim_result_latency_ms,
                  config.sim_egress_latency_ms)
        if not all(v >= 0 for v in values):  # also refuses NaN
            raise SystemExit(f"--sim-*-latency-ms must be >= 0, got {values}")
        return cls(*(v / 1e3 for v in values))


@dataclass
class KVTransfer:
    """One hand-off's blocks moving from a prefill replica to a decode replica."""

    transfer_id: int
    request_id: str
    source: str  # the prefill replica's name
    destination: str  # the decode replica's name
    num_blocks: int = 0  # blocks copied (those the destination's prefix cache did not hold)
    nbytes: int = 0
    ready: float | None = None  # the destination's plan carrying the load started on its device
    start: float | None = None  # the link took it
    end: float | None = None  # the last byte arrived


class VirtualReplica:
    """One replica: a scheduler core and its window, a sim runner, a device running one step at a time."""

    def __init__(self, name: str, runner, sched_config, clock, role: WorkerRole = WorkerRole.BOTH) -> None:
        from scheduler_service.core.scheduler import Scheduler
        from scheduler_service.step_loop import StepLoop

        self.name, self.role, self.runner = name, role, runner
        self.scheduler = Scheduler(sched_config, clock=clock)
        self.loop = StepLoop(self.scheduler)
        self.after_commit = False  # the next pump follows a commit (the window's lateness signal)
        self.device: collections.deque = collections.deque()  # (result, when it reaches the scheduler), in plan order
        self.device_free = 0.0
        self.busy = 0.0
        self.num_steps = 0
        self.link_free = 0.0  # the inbound KV link is free from then on

    @property
    def next_result(self) -> float | None:
        return self.device[0][1] if self.device else None

    def has_work(self) -> bool:
        return bool(self.device) or self.scheduler.has_unfinished_requests()


class VirtualCluster:
    """Replicas on one virtual clock: arrivals, routing, plans, device steps, commits, KV transfers."""

    def __init__(self, replicas: list[tuple[str, object, object, WorkerRole]], control: ControlPlane = ControlPlane(),
                 link=None, bytes_per_block: int = 0) -> None:
        """replicas: (name, sim runner, scheduler config, role) each; `link` (a `LinkProfile`) and
        `bytes_per_block` price the KV transfers of disaggregated replicas."""
        self.control, self.link, self.bytes_per_block = control, link, bytes_per_block
        self.now = 0.0
        self.replicas = [VirtualReplica(name, runner, config, self._clock, role)
                         for name, runner, config, role in replicas]
        if not self.replicas:
            raise ValueError("a virtual cluster needs at least one replica")
        roles = {r.role for r in self.replicas}
        if WorkerRole.PREFILL in roles and WorkerRole.DECODE not in roles:
            raise ValueError("prefill replicas need at least one decode replica")
        if WorkerRole.PREFILL in roles and link is None:
            raise ValueError("disaggregated replicas need a KV link profile")
        prefills = WorkerRole.PREFILL in roles
        self.takers = [r for r in self.replicas if r.role is not WorkerRole.DECODE or not prefills]
        self.decoders = [r for r in self.replicas if r.role is WorkerRole.DECODE]
        self.logs: dict[str, SimRequestLog] = {}  # request id -> its log, once admitted
        self.requests: dict[str, object] = {}  # request id -> the Request, once admitted (the latest core's)
        self.transfers: list[KVTransfer] = []  # every hand-off, in order
        self._open: dict[int, tuple[KVTransfer, VirtualReplica, VirtualReplica]] = {}  # transfer id -> it, src, dst
        self._transfer_ids = itertools.count(1)
        self._reports: list = []  # heap of (when the decode core hears the load ended, transfer id)
        self._follow_up = None
        self._pending: list = []  # heap of (arrival at the scheduler, sequence number, Request, log)
        self._arrivals = itertools.count()  # the sequence numbers: equal times keep their order

    def _clock(self) -> float:
        return self.now

    @property
    def busy(self) -> float:
        return sum(r.busy for r in self.replicas)

    @property
    def num_steps(self) -> int:
        return sum(r.num_steps for r in self.replicas)

    def run(self, arrivals: list[tuple[float, object, SimRequestLog]], follow_up=None) -> None:
        """arrivals: (time, Request, log); fills each log. `follow_up(request, log)`, called as
        a request finishes (closed loop: a conversation's next turn), returns the next
        (time, Request, log) to arrive, or None."""
        pending, self._follow_up = self._pending, follow_up
        for t, request, log in arrivals:
            self._arrive(t, request, log)
        while pending or self._reports or any(r.has_work() for r in self.replicas):
            while pending and pending[0][0] <= self.now:
                _, _, request, log = heapq.heappop(pending)
                self._admit(request, log)
            while self._reports and self._reports[0][0] <= self.now:
                self._loaded(heapq.heappop(self._reports)[1])
            for replica in self.replicas:
                self._pump(replica)
            for source in self._release_sources():  # freed blocks there: it may admit more now
                self._pump(source)
            times = [r.next_result for r in self.replicas if r.device]
            times += [q[0][0] for q in (pending, self._reports) if q]
            if not times:
                if not any(r.scheduler.has_unfinished_requests() for r in self.replicas):
                    return  # the last arrivals were rejected
                raise SimulationStalled(f"simulation stuck at t={self.now}: nothing to plan, "
                                        + "; ".join(f"{r.name}: {r.scheduler.stats()}" for r in self.replicas))
            self.now = max(self.now, min(times))
            due = [r for r in self.replicas if r.device and r.next_result <= self.now]
            if due:
                replica = min(due, key=lambda r: r.next_result)  # the earliest; ties to the first replica
                self._commit(replica)
                stall = replica.scheduler.stall()
                if stall is not None:
                    where = f" on {replica.name}" if len(self.replicas) > 1 else ""
                    raise SimulationStalled(f"simulation livelocked at t={self.now:.3f} s{where}: {stall}")

    def _admit(self, request, log: SimRequestLog) -> None:
        from scheduler_service.core.scheduler import RequestRejected

        replica = min(self.takers, key=lambda r: r.scheduler.num_unfinished)
        try:
            replica.scheduler.add_request(request)
        except RequestRejected as exc:  # e.g. longer than the model or the KV pool
            log.finish, log.finish_reason = self.now, f"REJECTED: {exc}"
            return
        log.replica = replica.name
        self.logs[request.request_id] = log
        self.requests[request.request_id] = request

    def _pump(self, replica: VirtualReplica) -> None:
        on_commit, replica.after_commit = replica.after_commit, False
        while (plan := replica.loop.plan_next(on_commit)) is not None:
            for r in plan.new_requests:  # the queue wait ends when a plan first takes the request
                log = self.logs[r.request_id]
                log.first_scheduled = self.now if log.first_scheduled is None else log.first_scheduled
            sampled, seconds, failed = replica.runner.apply(plan)
            start = max(self.now + self.control.plan, replica.device_free)
            replica.device_free = start + seconds
            replica.busy += seconds
            result = StepResult(plan.step_id, sampled, failed=failed, speculation=replica.runner.last_speculation,
                                timing=WorkerTiming(forward_start=start, forward_end=replica.device_free))
            replica.device.append((result, replica.device_free + self.control.result))
            for load in plan.kv_loads:
                self._start_transfer(replica, load, start)
        for request_id, refusal in replica.scheduler.take_shed():  # admission control refused it in the queue
            log = self.logs[request_id]
            log.finish, log.finish_reason = self.now + self.control.egress, f"REJECTED: {refusal}"

    def _commit(self, replica: VirtualReplica) -> None:
        result, _ = replica.device.popleft()
        _, events = replica.loop.commit(result)
        replica.after_commit = True
        replica.num_steps += 1
        for event in events:
            log, seen = self.logs[event.request_id], self.now + self.control.egress
            log.token_times += [seen] * len(event.new_token_ids)
            if event.finish_reason is not None:
                log.finish, log.finish_reason = seen, event.finish_reason.name
                nxt = self._follow_up and self._follow_up(self.requests[event.request_id], log)
                if nxt:
                    self._arrive(*nxt)
        if replica.role is WorkerRole.PREFILL:
            for handoff in replica.scheduler.take_handoffs():
                self._hand_off(replica, handoff)

    def _hand_off(self, source: VirtualReplica, handoff) -> None:
        """The engine's move: the least-loaded decode replica takes the request and its blocks."""
        request = handoff.request
        destination = min(self.decoders, key=lambda r: r.scheduler.num_unfinished)
        transfer = KVTransfer(next(self._transfer_ids), request.request_id, source.name, destination.name)
        self.transfers.append(transfer)
        self._open[transfer.transfer_id] = (transfer, source, destination)
        destination.scheduler.add_transferred(request, source.name, tuple(handoff.block_ids), transfer.transfer_id)
        self.requests[request.request_id] = request
        self.logs[request.request_id].decode_replica = destination.name

    def _start_transfer(self, destination: VirtualReplica, load, ready: float) -> None:
        transfer, _, _ = self._open[load.transfer_id]
        transfer.num_blocks = len(load.src_block_ids)
        transfer.nbytes = transfer.num_blocks * self.bytes_per_block
        transfer.ready = ready
        transfer.start = max(ready, destination.link_free)
        transfer.end = destination.link_free = transfer.start + self.link.transfer_seconds(transfer.nbytes)
        heapq.heappush(self._reports, (transfer.end + self.control.result, transfer.transfer_id))

    def _loaded(self, transfer_id: int) -> None:
        _, _, destination = self._open[transfer_id]
        destination.scheduler.kv_loaded(KVLoaded(transfer_id))

    def _release_sources(self) -> list[VirtualReplica]:
        """The engine's move: the transfers whose source blocks a decode core no longer needs
        (loaded, or all in its prefix cache, or the request ended) free them on their prefill
        core. The prefill replicas that freed blocks."""
        sources = []
        for destination in self.decoders:
            for transfer_id in destination.scheduler.take_released_sources():
                transfer, source, _ = self._open.pop(transfer_id)
                source.scheduler.release_handoff(transfer.request_id)
                if source not in sources:
                    sources.append(source)
        return sources

    def _arrive(self, t: float, request, log: SimRequestLog) -> None:
        heapq.heappush(self._pending, (t + self.control.ingress, next(self._arrivals), request, log))
