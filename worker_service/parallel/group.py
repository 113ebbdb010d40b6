"""The tensor-parallel process group of one worker process (one group per process at a time).

Rank 0's worker listens on its rendezvous address (`host:port`, the TCPStore); every
collective and the rendezvous itself give up after `timeout_s`, so a dead peer ends the
group with an error instead of a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class GroupSpec:
    """What the scheduler told this worker: its place in a tensor-parallel group."""

    group_id: str
    rank: int
    size: int
    master_addr: str  # rank 0's rendezvous host
    master_port: int  # rank 0's rendezvous port
    backend: str  # "gloo" or "nccl"
    timeout_s: float = 60.0


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_group(spec: GroupSpec) -> None:
    """Join the group (blocks until every rank arrived, or `timeout_s`)."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group is already initialised in this process")
    dist.init_process_group(
        spec.backend, init_method=f"tcp://{spec.master_addr}:{spec.master_port}", rank=spec.rank,
        world_size=spec.size, timeout=datetime.timedelta(seconds=spec.timeout_s),
    )


def destroy_group() -> None:
    """Leave the group (idempotent): after a peer died or the scheduler closed the group."""
    if dist.is_initialized():
        dist.destroy_process_group()
