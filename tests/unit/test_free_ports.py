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

import pytest

from stepahead.ports import free_port, free_ports


@pytest.fixture
def kernel_range(tmp_path, monkeypatch):
    """Stands in for /proc/sys/net/ipv4/ip_local_port_range (the kernel's format: low, tab, high)."""
    def give(low: int, high: int) -> None:
        path = tmp_path / "ip_local_port_range"
        path.write_text(f"{low}\t{high}\n")
        monkeypatch.setattr("stepahead.ports._EPHEMERAL_RANGE", path)
    return give


def assert_free(ports: list[int]) -> None:
    for port in ports:
        with socket.socket() as s:  # a listener can have it
            s.bind(("127.0.0.1", port))
            s.listen()


def test_ports_come_from_below_the_ephemeral_range_and_are_free(kernel_range):
    kernel_range(32768, 60999)  # Linux's default
    ports = free_ports(16) + [free_port() for _ in range(16)]
    assert len(set(ports[:16])) == 16, "one pick gives distinct ports"
    assert all(10000 <= p < 32768 for p in ports), ports
    assert_free(ports[:4])


def test_a_range_with_no_room_below_it_falls_back_to_the_kernels_pick(kernel_range):
    kernel_range(1024, 65535)
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert_free(ports[:4])


def test_ports_already_handed_out_are_not_picked_again(monkeypatch):
    *held, a, b = free_ports(6)  # `held`: named in a daemon's flags, not yet bound by it
    monkeypatch.setattr("stepahead.ports._listen_ports", lambda: [*held, a, b])  # a pool of six
    assert sorted(free_ports(2, exclude=held)) == sorted([a, b])
