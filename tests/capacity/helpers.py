"""A router's real RouterMetrics (rendered by the router's own module) driven with a known load."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tilepd.contracts.service_configs import DecodeEndpoint
from tilepd.router.leases import NodePool, NodeState
from tilepd.router.metrics import RouterMetrics

REPO = Path(__file__).resolve().parents[2]


class ManualClock:
    """A clock the test steps by hand, for the pool's lease and busy-level times (no real waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def router_metrics(nodes: int = 2, clock: ManualClock | None = None) -> tuple[RouterMetrics, NodePool]:
    endpoints = [DecodeEndpoint(name=f"d{i}", host="127.0.0.1", ctrl_port=1, http_port=2) for i in range(nodes)]
    pool = NodePool(nodes=[NodeState(endpoint=e) for e in endpoints], clock=clock or time.monotonic)
    for n in pool.nodes:
        pool.set_in_rotation(n, True)
    return RouterMetrics(pool, breaker_failures=3), pool


class PoolDriver:
    """Real leases of a real pool on a `ManualClock`: runs the pool at a busy level for a number of releases."""

    def __init__(self, metrics: RouterMetrics, pool: NodePool, clock: ManualClock) -> None:
        self.metrics, self.pool, self.clock = metrics, pool, clock
        self.held: list = []  # leases still held, oldest first

    def at_level(self, level: int, releases: int, hold_s: float, wait_s: float = 0.0) -> None:
        """Keep `level` nodes leased for `releases` releases, each lease held `hold_s` (so one release every
        hold_s / level seconds, all at that level); the leases stay held afterwards."""

        async def go() -> None:
            while len(self.held) < level:
                self.held.append(await self.pool.acquire(1.0))
            while len(self.held) > level:
                self.held.pop(0).release()
            for _ in range(releases):
                self.clock.advance(hold_s / level)
                self.held.pop(0).release()
                self.held.append(await self.pool.acquire(1.0))
                self.metrics.lease_wait_seconds.observe(wait_s)
                self.metrics.routes.labels("low_latency", "default").inc()

        asyncio.run(go())


def lease_and_release(metrics: RouterMetrics, pool: NodePool, count: int) -> None:
    """Lease and release nodes through the real pool, as the router does: its release hook records each hold."""

    async def go() -> None:
        for _ in range(count):
            lease = await pool.acquire(1.0)
            metrics.lease_wait_seconds.observe(lease.waited_s)
            lease.release()

    asyncio.run(go())


def drive(metrics: RouterMetrics, *, served: int, hold_s: float, wait_s: float, refused: int = 0, fallbacks: int = 0) -> None:
    """`served` requests that waited `wait_s` and held a node `hold_s`; `refused` 429s and `fallbacks` after the queue
    timeout."""
    for _ in range(served):
        metrics.lease_wait_seconds.observe(wait_s)
        metrics.observe_hold(hold_s)
        metrics.routes.labels("low_latency", "default").inc()
        metrics.responses.labels("low_latency", "200").inc()
    for _ in range(refused):
        metrics.routes.labels("low_latency", "busy").inc()
        metrics.responses.labels("low_latency", "429").inc()
    for _ in range(fallbacks):
        metrics.routes.labels("native", "busy").inc()
        metrics.responses.labels("native", "200").inc()


def local_topology(tmp_path: Path, router_port: int) -> Path:
    """The bundled local.yaml with the router on `router_port`."""
    text = (REPO / "topology_examples" / "local.yaml").read_text()
    text, n = re.subn(r"(router:\n(?:  .*\n)*?  port: )\d+", rf"\g<1>{router_port}", text)
    assert n == 1, "local.yaml's router port not found"
    out = tmp_path / "local.yaml"
    out.write_text(text)
    return out


@contextmanager
def serving_metrics(metrics: RouterMetrics, between_scrapes: Callable[[], None]) -> Iterator[int]:
    """An HTTP server answering /metrics with the router's own rendering of `metrics` (its port is yielded);
    `between_scrapes` drives the load just before the second scrape, and exactly two scrapes must come."""
    scrapes: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            scrapes.append(self.path)
            if len(scrapes) == 2:
                between_scrapes()
            body = metrics.render()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
    assert scrapes == ["/metrics", "/metrics"]
