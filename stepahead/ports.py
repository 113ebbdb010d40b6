"""Ports for listeners: picked before they are bound (a daemon's flag, a rendezvous), checked
before a daemon starts its work, and held by one listener only."""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

__all__ = ["EXCLUSIVE_PORT", "check_free", "free_port", "free_ports", "host_port"]

# A grpc server option: the listener holds its port alone. grpc's default on Linux sets
# SO_REUSEPORT, so a second daemon started on a running one's port binds as well and the kernel
# splits new connections between the two (a second scheduler would silently take some of the
# workers and gateways); without it, the second one fails to bind and says so.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 literal bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_free(flag: str, host: str, port: int) -> None:
    """ConfigError naming `flag` when another process listens on `host:port` (0: any free
    port, nothing to check), so that a daemon says so before it starts its work."""
    if not port:
        return
    from stepahead.config import ConfigError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the daemons bind
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise ConfigError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                              f"stop what holds it or pick another {flag}") from None


def free_port(host: str = "127.0.0.1", exclude: Collection[int] = ()) -> int:
    return free_ports(1, host, exclude)[0]


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICK = random.Random()  # its own generator: a test seeding `random` must not make processes pick alike


def _listen_ports() -> range | None:
    """Ports below the kernel's ephemeral range, where no outgoing connection takes its local
    port; None where that range leaves no room (then bind(0) picks)."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(10000, low) if low - 10000 >= 1000 else None


def free_ports(n: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """`n` distinct ports free now (all bound at once while they are picked), none of
    `exclude` (ports already handed to a daemon that has not bound them yet). They come from
    below the ephemeral range: a port from bind(0) is one that the daemons' own outgoing
    connections (worker -> scheduler, gateway -> scheduler) may take as their local port
    between the pick and the listener's bind, and the listener then fails to start."""
    pool, socks = _listen_ports(), []
    try:
        for _ in range(100 * n):
            s = socket.socket()
            try:
                s.bind((host, _PICK.choice(pool) if pool else 0))
            except OSError:  # taken: another one
                s.close()
                continue
            if s.getsockname()[1] in exclude:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [s.getsockname()[1] for s in socks]
        raise OSError(f"found {len(socks)} of {n} free ports on {host}")
    finally:
        for s in socks:
            s.close()
