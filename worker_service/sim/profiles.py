"""Accelerator profiles of the simulated worker (`--sim-profile h100|h200|a100|FILE.json`) and the
links between replicas that KV loads cross (`--sim-kv-link ib|nvlink|pcie|FILE.json`, at the end).

Peak numbers are the vendors' public datasheet values (dense, no sparsity); the efficiency
factors and the per-step overhead are this project's assumptions (see docs/sim.md):

- H100 SXM5 80 GB (NVIDIA H100 Tensor Core GPU datasheet): 80 GB HBM3, 3.35 TB/s,
  BF16 Tensor Core 989 TFLOPS dense (1,979 "with sparsity"), PCIe Gen5 x16 (64 GB/s per way).
- H200 SXM 141 GB (NVIDIA H200 Tensor Core GPU datasheet): 141 GB HBM3e, 4.8 TB/s,
  BF16 989 TFLOPS dense (1,979 with sparsity), PCIe Gen5 x16.
- A100 SXM4 80 GB (NVIDIA A100 Tensor Core GPU datasheet): 80 GB HBM2e, 2,039 GB/s,
  BF16 312 TFLOPS dense (624 with sparsity), PCIe Gen4 x16 (32 GB/s per way).

A JSON profile file holds the same keys as `AcceleratorProfile` (all required but `name`,
which defaults to the file's stem).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from stepahead.config import ConfigError

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class AcceleratorProfile:
    name: str
    memory_bytes: float  # device memory
    memory_bandwidth: float  # peak bytes/s of device memory
    peak_flops: float  # peak dense bf16/fp16 FLOP/s
    host_link_bandwidth: float  # bytes/s one way between host and device memory (swap)
    bandwidth_efficiency: float = 0.8  # achievable fraction of memory_bandwidth
    compute_efficiency: float = 0.6  # achievable fraction of peak_flops
    step_overhead_s: float = 0.0005  # fixed cost of every step (launches, sampling, sync)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "name":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"sim profile {self.name!r}: {f.name} must be a finite number, got {value!r}")
            if value < 0 or (value == 0 and f.name != "step_overhead_s"):
                raise ValueError(f"sim profile {self.name!r}: {f.name} must be positive, got {value!r}")
        for f in ("bandwidth_efficiency", "compute_efficiency"):
            if getattr(self, f) > 1:
                raise ValueError(f"sim profile {self.name!r}: {f} must be at most 1, got {getattr(self, f)}")


BUILTIN_PROFILES: dict[str, AcceleratorProfile] = {
    "h100": AcceleratorProfile("h100", memory_bytes=80 * GB, memory_bandwidth=3.35 * TB,
                               peak_flops=989e12, host_link_bandwidth=64 * GB),
    "h200": AcceleratorProfile("h200", memory_bytes=141 * GB, memory_bandwidth=4.8 * TB,
                               peak_flops=989e12, host_link_bandwidth=64 * GB),
    "a100": AcceleratorProfile("a100", memory_bytes=80 * GB, memory_bandwidth=2.039 * TB,
                               peak_flops=312e12, host_link_bandwidth=32 * GB),
}


def load_profile(spec: str) -> AcceleratorProfile:
    """A built-in profile name, or the path of a JSON file with AcceleratorProfile's keys."""
    return _load("sim profile", AcceleratorProfile, BUILTIN_PROFILES, spec)


class ProfileError(ConfigError):
    """A sim profile or link the operator named that cannot be used (the command exits 2 with it)."""


def _load(what: str, cls, builtins: dict, spec: str):
    """`builtins[spec]`, or an instance of the dataclass `cls` from the JSON file at `spec`
    (its keys, `name` defaulting to the file's stem); ProfileError naming what is wrong."""
    if spec in builtins:
        return builtins[spec]
    path = Path(spec)
    if not path.is_file():
        raise ProfileError(f"{what} {spec!r} is neither a built-in ({', '.join(builtins)}) nor a file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{what} {path}: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{what} {path}: expected a JSON object")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ProfileError(f"{what} {path}: unknown keys {unknown}; known: {sorted(known)}")
    raw.setdefault("name", path.stem)
    try:
        return cls(**raw)
    except TypeError as exc:  # a required key is missing
        raise ProfileError(f"{what} {path}: {exc}") from None
    except ValueError as exc:  # a value out of range (the dataclass's own check names it)
        raise ProfileError(f"{path}: {exc}") from None


# ---- links between replicas (KV transfers of disaggregated prefill/decode) --------------------

US = 1e-6


@dataclass(frozen=True)
class LinkProfile:
    """A link a KV load crosses from a prefill replica to a decode replica: `--sim-kv-link`.

    A transfer of n bytes takes `latency_s + n / bandwidth` (one message, no contention)."""

    name: str
    bandwidth: float  # bytes/s, one way
    latency_s: float  # seconds before the first byte arrives

    def __post_init__(self) -> None:
        for name in ("bandwidth", "latency_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"sim link {self.name!r}: {name} must be a finite number, got {value!r}")
            if value < 0 or (value == 0 and name == "bandwidth"):
                raise ValueError(f"sim link {self.name!r}: {name} must be positive, got {value!r}")

    def transfer_seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


BUILTIN_LINKS: dict[str, LinkProfile] = {
    # NVLink 4 (NVIDIA H100 SXM5 datasheet): 900 GB/s bidirectional per GPU, 450 GB/s each way;
    # latency: a peer-to-peer copy's launch and first bytes, a few microseconds.
    "nvlink": LinkProfile("nvlink", bandwidth=450 * GB, latency_s=2 * US),
    # NDR InfiniBand (NVIDIA ConnectX-7 datasheet): 400 Gb/s per port = 50 GB/s each way; RDMA
    # latency across one switch, a few microseconds.
    "ib": LinkProfile("ib", bandwidth=50 * GB, latency_s=5 * US),
    # PCIe Gen5 x16 (PCI-SIG Base Specification 5.0): 32 GT/s x 16 lanes, about 64 GB/s each way;
    # staged through host memory, so the highest latency of the three.
    "pcie": LinkProfile("pcie", bandwidth=64 * GB, latency_s=10 * US),
}


def load_link_profile(spec: str) -> LinkProfile:
    """A built-in link name (nvlink, ib, pcie), or the path of a JSON file with LinkProfile's
    keys (`bandwidth`, `latency_s`; `name` defaults to the file's stem). The offline
    simulator and the sim worker (`--sim-kv-link`) both read links through this."""
    return _load("sim link", LinkProfile, BUILTIN_LINKS, spec)
