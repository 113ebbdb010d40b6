"""CUDA streams and events of one worker; the same calls are no-ops on CPU.

Three streams, all created by the runner and entered explicitly by whichever thread
launches a step (a CUDA "current stream" is per thread, so nothing here depends on the
thread that built the runner):

- compute stream (dedicated, never the legacy default stream, so a step can be captured
  into a CUDA graph): swaps, the forward pass, sampling;
- copy stream: host-to-device copies of a step's inputs from pinned, contiguous buffers;
- output stream: the device-to-host copy of the sampled ids into a pinned buffer, with
  an event the sender thread waits on (the step's one host synchronisation);
- transfer stream: KV blocks read for, or written by, another replica (disaggregation),
  from a thread of their own; the scheduler keeps those blocks out of every plan meanwhile.

Device input buffers and the sampled-ids buffers are double-buffered by step parity
(`slot = launch index % 2`), so the copy of step t+1 overlaps the compute of step t. Every
cross-stream dependency is one of the waits below (W0-W3); the two host-side guards are in
the runner (H1: `_inputs_copied`, H2: `_retire`). `tests/gpu/test_cuda_runner.py` has a
table of which test breaks when each is removed.

No wait orders the compute stream after the D2H of the step two back, although that step
and this one share a slot of the device sampled-ids buffer: H2 (the host has read that
step's ids, so its D2H is complete) already precedes every write to the slot.
"""

from __future__ import annotations

import contextlib

import torch


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (a list or a CPU tensor) on `device`, without a host wait.

    On CUDA the values go through pinned memory with a non-blocking copy on the current
    stream (the caching host allocator keeps the pinned block until the copy ran). A plain
    `torch.tensor(values, device=cuda)` is a pageable, blocking copy: the host would wait
    for every step queued before it.
    """
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device=device, dtype=dtype)
    return host.to(dtype=dtype).pin_memory().to(device, non_blocking=True)


class StepEvent:
    """A recorded CUDA event, or an always-complete stand-in on CPU."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        return self._event is None or self._event.query()


class DeviceStreams:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.Stream(device)
            self.copy = torch.cuda.Stream(device)
            self.output = torch.cuda.Stream(device)
            self.transfer = torch.cuda.Stream(device)

    # -- entering streams ---------------------------------------------------------------

    def on_compute_stream(self):
        return torch.cuda.stream(self.compute) if self.cuda else contextlib.nullcontext()

    def on_copy_stream(self):
        return torch.cuda.stream(self.copy) if self.cuda else contextlib.nullcontext()

    def on_output_stream(self):
        return torch.cuda.stream(self.output) if self.cuda else contextlib.nullcontext()

    def on_transfer_stream(self):
        """KV transfers (disaggregation): reads and writes of blocks no in-flight step touches,
        from a gRPC or loader thread, beside the steps."""
        return torch.cuda.stream(self.transfer) if self.cuda else contextlib.nullcontext()

    def record(self, stream_name: str) -> StepEvent:
        """An event at the current end of the named stream ("compute", "copy", "output")."""
        if not self.cuda:
            return StepEvent()
        event = torch.cuda.Event()
        event.record(getattr(self, stream_name))
        return StepEvent(event)

    # -- the cross-stream waits -----------------------------------------------------------

    def wait_for_constructor(self) -> None:
        """W0: the weights, KV pool and buffers were initialised (asynchronously) on the
        constructing thread's current stream; the first step's copies and compute come after."""
        if self.cuda:
            current = torch.cuda.current_stream(self.compute.device)
            self.compute.wait_stream(current)
            self.copy.wait_stream(current)

    def transfer_waits_for_compute(self) -> None:
        """W4: a KV read or write comes after every step launched so far (for a read, the one
        that wrote its blocks; for a write, a swap-out of the blocks' former contents)."""
        if self.cuda:
            self.transfer.wait_stream(self.compute)

    def synchronize_transfer(self) -> None:
        """A KV write is on the device before the load is reported (later plans use the blocks)."""
        if self.cuda:
            self.transfer.synchronize()

    def copy_waits_for_compute(self, compute_done: StepEvent) -> None:
        """W1: the device input buffers of a slot are overwritten only after the compute of
        the step that last read them (two steps back) is done; the previous step's compute
        (other slot) may still be running."""
        if self.cuda and compute_done._event is not None:
            self.copy.wait_event(compute_done._event)

    def compute_waits_for_copies(self) -> None:
        """W2: compute starts only after this step's inputs landed on the device."""
        if self.cuda:
            self.compute.wait_stream(self.copy)

    def output_waits_for_compute(self) -> None:
        """W3: the D2H copy of the sampled ids starts only after sampling wrote them."""
        if self.cuda:
            self.output.wait_stream(self.compute)
