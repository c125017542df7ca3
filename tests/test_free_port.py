"""free_port(): ports for servers the tests and benches start, away from the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from tilepd.connector import launch
from tilepd.connector.launch import free_port


def test_ports_are_outside_the_ephemeral_range_distinct_and_bindable() -> None:
    lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == len(ports)
    assert not any(lo <= p <= hi for p in ports), "a port an outgoing connection could take meanwhile"
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_never_handed_out(monkeypatch) -> None:
    """Narrow the window to two ports and occupy one: only the other comes back (then the fallback)."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        taken = a.getsockname()[1]
        a.listen()
        monkeypatch.setattr(launch, "_port_window", lambda: (taken, taken + 1))
        monkeypatch.setattr(launch, "_handed_out", set())
        try:
            b.bind(("127.0.0.1", taken + 1))
            b.close()
            free_other = True
        except OSError:
            free_other = False
        port = free_port()
        assert port != taken
        if free_other:
            assert port == taken + 1
        assert free_port() not in (taken, port)  # both used up: falls back to a kernel-chosen port
