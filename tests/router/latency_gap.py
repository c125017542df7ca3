"""One check for "the timeline's total is what the client measured", shared by the in-process and real-stack tests."""

from __future__ import annotations


def assert_total_is_the_clients(pairs: list[tuple[float, float]], floor_ms: float = 25.0) -> None:
    """`pairs` holds (router total, client latency) in ms for a few requests. The gap between them is what lies outside
    the router's clock (the client's own serialising, the loopback or thread hops, uvicorn's parse before the
    middleware), taken as the median over the requests: on a loaded 2-core box the client can be descheduled for
    tens of ms around any one request (CI once: 193 ms on the router's clock, 211 ms on the client's; in process,
    321 ms against 378 ms; a fresh-clone run: gaps of 5-34 ms, median 19 ms, on 189-758 ms requests, beside vLLM's
    busy-polling NIXL threads). The phases' sum is checked against the router's total exactly elsewhere. That outside part is bounded by 5% or `floor_ms`, whichever is larger; a phase left out
    of the timeline (the shortest, admission or convert, aside) costs every request more than that, and the router's
    total can never exceed what the client saw."""
    assert len(pairs) >= 3, pairs
    gaps = sorted(client - server for server, client in pairs)
    median_client = sorted(client for _, client in pairs)[len(pairs) // 2]
    gap = gaps[len(gaps) // 2]
    assert -1.0 <= gap <= max(floor_ms, 0.05 * median_client), pairs
