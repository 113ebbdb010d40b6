"""Ports picked for the daemons' listeners lie outside the kernel's ephemeral range.

`stepahead serve`, the test launcher and a tensor-parallel rendezvous pick their listeners'
ports before the daemons bind them. A port from bind(0) comes from the ephemeral range, the
range outgoing connections take their local port from, so a worker's or gateway's connection
to the scheduler could take it first and the listener failed with EADDRINUSE (a capacity
sweep lost its 512-stream row that way). A port already named in a daemon's flags is not
picked again for another.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stepahead.ports import free_port, free_ports

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    return int(_EPHEMERAL_RANGE.read_text().split()[0])


@pytest.mark.skipif(not _EPHEMERAL_RANGE.is_file() or ephemeral_low() < 11000,
                    reason="no ephemeral range with room below it")
def test_ports_come_from_below_the_ephemeral_range_and_are_free():
    ports = free_ports(16) + [free_port() for _ in range(16)]
    assert len(set(ports[:16])) == 16, "one pick gives distinct ports"
    assert all(1024 <= p < ephemeral_low() for p in ports), (ports, ephemeral_low())
    for port in ports[:4]:
        with socket.socket() as s:  # free: a listener can have it
            s.bind(("127.0.0.1", port))
            s.listen()



def test_ports_already_handed_out_are_not_picked_again(monkeypatch):
    *held, a, b = free_ports(6)  # `held`: named in a daemon's flags, not yet bound by it
    monkeypatch.setattr("stepahead.ports._listen_ports", lambda: [*held, a, b])  # a pool of six
    assert sorted(free_ports(2, exclude=held)) == sorted([a, b])
