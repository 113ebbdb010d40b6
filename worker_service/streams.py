"""CUDA streams and events of one worker; the same calls are no-ops on CPU.

- copy stream: host-to-device copies of a step's inputs (from pinned buffers);
- main stream: the forward pass and sampling, after waiting for the copy event;
- output stream: the device-to-host copy of sampled ids, after waiting for sampling,
  with an event the sender thread waits on (the step's one synchronisation point).
"""

from __future__ import annotations

import contextlib

import torch


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
            self.main = torch.cuda.current_stream(device)
            self.copy = torch.cuda.Stream(device)
            self.output = torch.cuda.Stream(device)

    def on_copy_stream(self):
        return torch.cuda.stream(self.copy) if self.cuda else contextlib.nullcontext()

    def record(self, stream_name: str) -> StepEvent:
        """An event at the current end of the named stream ("main", "copy", "output")."""
        if not self.cuda:
            return StepEvent()
        event = torch.cuda.Event()
        event.record(getattr(self, stream_name))
        return StepEvent(event)

    def main_waits_for_copies(self) -> None:
        """Compute starts only after this step's inputs landed on the device."""
        if self.cuda:
            self.main.wait_stream(self.copy)

    def copy_waits_for_main(self) -> None:
        """The next step's copies may overwrite device buffers only after this step's compute."""
        if self.cuda:
            self.copy.wait_stream(self.main)

    def to_host(self, sampled: torch.Tensor) -> tuple[torch.Tensor, StepEvent]:
        """Start the D2H copy of `sampled` on the output stream; returns (host tensor, done event)."""
        if not self.cuda:
            return sampled, StepEvent()
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        self.output.wait_stream(self.main)
        with torch.cuda.stream(self.output):
            host.copy_(sampled, non_blocking=True)
            sampled.record_stream(self.output)  # keep its memory alive until the copy ran
        return host, self.record("output")
