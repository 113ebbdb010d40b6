"""Where a running `stepahead serve` tells local tools how to reach its scheduler.

`serve` picks a scheduler port and a cluster token per run; `stepahead trace` and
`stepahead bench --scheduler` need both. As Jupyter does with its runtime files, `serve`
writes them to `<cache dir>/run/serve-<pid>.json`, readable only by the user who started it,
and removes the file when it stops. `find(scheduler)` returns the live entry for an address
(or the newest live one), so the tools work against `serve` without flags.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def run_dir() -> Path:
    from model_zoo.builtin_models import cache_dir

    return cache_dir() / "run"


def write(info: dict) -> Path:
    """Write this process's entry (mode 0600: the cluster token is a credential)."""
    directory = run_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"serve-{os.getpid()}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), **info}, f)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: not ours to use
        return False
    return True


def find(scheduler: str | None = None) -> dict | None:
    """The live entry whose scheduler is `scheduler`, else (no address given) the newest."""
    directory = run_dir()
    if not directory.is_dir():
        return None
    entries = []
    for path in directory.glob("serve-*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written, or not ours to read
        if isinstance(entry, dict) and isinstance(entry.get("pid"), int) and _alive(entry["pid"]):
            entries.append((path.stat().st_mtime, entry))
    matching = [(t, e) for t, e in entries if scheduler is None or e.get("scheduler") == scheduler]
    return max(matching, key=lambda te: te[0])[1] if matching else None


def scheduler_access(target: str | None, token: str | None) -> tuple[str, str | None]:
    """(scheduler address, cluster token) for a tool: the flags, else STEPAHEAD_CLUSTER_TOKEN,
    else a running `serve`'s entry; the address defaults to that serve's scheduler."""
    token = token or os.environ.get("STEPAHEAD_CLUSTER_TOKEN")
    entry = find(target)
    if target is None:
        target = entry["scheduler"] if entry else "127.0.0.1:50051"
    if token is None and entry is not None:
        token = entry.get("cluster_token")
    return target, token
