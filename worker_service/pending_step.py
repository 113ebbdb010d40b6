"""A launched step's results on their way to the host: `copy_to_host` starts the D2H copies
on the output stream, `PendingStep.ids()` / `wait()` read them after the step's one
host synchronisation (see `worker_service/model_runner.py`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import torch

from stepahead.plan import SpecOutcome, StepResult, WorkerTiming
from worker_service.input_batch import CachedRequest
from worker_service.logprobs import StepLogprobs
from worker_service.speculation import SpecOutputs
from worker_service.streams import DeviceStreams, StepEvent


@dataclass
class PendingStep:
    """A launched step whose sampled ids may still be on their way to the host."""

    step_id: int
    reqs: list[CachedRequest]  # sampling requests, in row order
    slots: list[int]  # index in each request's token_ids reserved for its sampled id
    host_ids: torch.Tensor  # [num_sampling] int64 view of a pinned buffer, valid once `done` completed
    done: StepEvent
    timing: WorkerTiming  # forward_end is set by wait() on CUDA
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed alone
    invalid_ids: tuple[str, ...] = ()  # of failed: requests whose grammar does not compile
    logprobs: StepLogprobs | None = None  # the step's logprob copies (None: no row asked)
    spec: SpecOutputs | None = None  # a speculative step's runs (resolved into the token lists once)
    outcomes: dict[str, SpecOutcome] = field(default_factory=dict)
    _ids: list[int] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ids(self) -> list[int]:
        """The sampled ids, read from the host buffer once (before the runner reuses it); fills
        the reserved slots of the token lists (a speculative step: writes its runs there)."""
        with self._lock:
            if self._ids is None:
                self.done.synchronize()  # the step's one host synchronisation
                if self.spec is None:
                    self._ids = self.host_ids.tolist()
                    for r, slot, t in zip(self.reqs, self.slots, self._ids):
                        r.token_ids[slot] = t
                else:
                    self._ids, self.outcomes = self.spec.resolve(self.reqs, self.slots)
                if not self.timing.forward_end:
                    self.timing = replace(self.timing, forward_end=time.time())
            return self._ids

    def wait(self) -> StepResult:
        """Block until the ids are on the host and in the token lists."""
        ids = self.ids()
        runs, prompt_lp = self.logprobs.collect(self.failed) if self.logprobs else ({}, {})
        outcomes = self.outcomes
        for rid, run in runs.items():  # accepted drafts' logprobs travel with their outcome
            if len(run) > 1:
                outcomes = {**outcomes, rid: replace(outcomes[rid], accepted_logprobs=tuple(run[:-1]))}
        lp = {rid: run[-1] for rid, run in runs.items()}
        return StepResult(self.step_id, {r.request_id: t for r, t in zip(self.reqs, ids)}, self.timing, self.failed,
                          lp, prompt_lp, outcomes, self.invalid_ids)


def copy_to_host(streams: DeviceStreams, sampled: torch.Tensor, host: torch.Tensor, step_id: int,
                 reqs: list[CachedRequest], slots: list[int], lp: StepLogprobs | None,
                 spec_dev: SpecOutputs | None) -> PendingStep:
    """D2H of the sampled ids `[n]` into `host` (a pinned slot view), of the logprobs and of a
    speculative step's runs `[n, 2 + K]`, on the output stream (CPU: copied at once)."""
    spec = None if spec_dev is None else replace(
        spec_dev, host=torch.empty(spec_dev.host.shape, dtype=torch.int64, pin_memory=streams.cuda))
    if streams.cuda:
        streams.output_waits_for_compute()  # W3
        with streams.on_output_stream():
            host.copy_(sampled, non_blocking=True)
            if spec is not None:
                spec.host.copy_(spec_dev.host, non_blocking=True)
                spec_dev.host.record_stream(streams.output)  # not reused before the copy ran
            if lp is not None:
                lp.to_host(pinned=True)
        done = streams.record("output")
    else:
        host.copy_(sampled)
        if spec is not None:
            spec.host.copy_(spec_dev.host)
        if lp is not None:
            lp.to_host(pinned=False)
        done = StepEvent()
    return PendingStep(step_id, reqs, slots, host, done, WorkerTiming(0.0, 0.0, 0.0, 0.0), logprobs=lp, spec=spec)
