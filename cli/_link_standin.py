"""A stand-in for `worker_service.sim.profiles.LinkProfile` / `load_link_profile` (being added on
another branch), with exactly their names and signatures. Delete this module, and import those
two from `worker_service.sim.profiles` instead, once they are there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class LinkProfile:
    """A link between two replicas' devices: bytes/s one way, and a fixed latency per transfer."""

    name: str
    bandwidth: float
    latency_s: float

    def transfer_seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


BUILTIN_LINKS = {
    "nvlink": LinkProfile("nvlink", 450 * GB, 2e-6),
    "ib": LinkProfile("ib", 50 * GB, 5e-6),
    "pcie": LinkProfile("pcie", 64 * GB, 10e-6),
}


def load_link_profile(name_or_path: str) -> LinkProfile:
    if name_or_path in BUILTIN_LINKS:
        return BUILTIN_LINKS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"link profile {name_or_path!r} is neither a built-in ({', '.join(BUILTIN_LINKS)}) nor a file")
    raw = json.loads(path.read_text())
    return LinkProfile(raw.get("name", path.stem), float(raw["bandwidth"]), float(raw["latency_s"]))
