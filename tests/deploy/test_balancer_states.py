"""Reading each router's state on a real HAProxy (the configuration tilepd renders, checks every 100 ms) in front of
one HTTP server that answers /health 200, then 503 as a draining router does, and a port nothing listens on."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tilepd.connector.launch import free_port
from tilepd.deploy.balancer import BalancerError, BalancerSpec, backend_states, takes_new, wait_state
from tilepd.plan.haproxy import haproxy_cfg
from tilepd.plan.model import BalancerBackend, BalancerPlan
from tests.waiting import wait_until

HAPROXY = Path("/usr/sbin/haproxy")


class _Router(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(type(self).status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[tuple[BalancerPlan, type[_Router]]]:
    """The balancer, and the handler class whose `status` its router answers /health with."""
    if not HAPROXY.exists():
        pytest.skip("haproxy is not installed (scripts/bootstrap.sh installs Debian's package)")
    handler = type("Router", (_Router,), {"status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stats = free_port()
    plan = BalancerPlan(name="lb", address="127.0.0.1", port=free_port(), external=False, stats_port=stats,
                        stats_url=f"http://127.0.0.1:{stats}/stats", backend="routers", check_interval_s=0.1, drain_timeout_s=5,
                        request_timeout_s=60, backends=[BalancerBackend(name="up", service="router-up", address="127.0.0.1",
                                                                        port=server.server_address[1]),
                                                        BalancerBackend(name="gone", service="router-gone", address="127.0.0.1",
                                                                        port=free_port())])
    cfg = tmp_path / "balancer.cfg"
    cfg.write_text(haproxy_cfg(plan, "test", "127.0.0.1"))
    proc = subprocess.Popen([str(HAPROXY), "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield plan, handler
    finally:
        proc.terminate()
        proc.wait(10)
        server.shutdown()


def _spec(plan: BalancerPlan, server: str) -> BalancerSpec:
    return BalancerSpec(stats_url=plan.stats_url, backend="routers", server=server, check_interval_s=0.1, checks_to_mark=2,
                        drain_timeout_s=5)


def test_states_and_waits_follow_the_routers_health(balancer: tuple[BalancerPlan, type[_Router]]) -> None:
    balancer, router = balancer
    assert wait_until(lambda: _states(balancer) == {"up": "UP", "gone": "DOWN"}, 10), _states(balancer)
    assert wait_state(_spec(balancer, "up"), taking_new=True, timeout_s=5) == "UP"
    router.status = 503  # draining: /health 503
    assert not takes_new(wait_state(_spec(balancer, "up"), taking_new=False, timeout_s=5))
    with pytest.raises(BalancerError, match="still shows router gone as 'DOWN'"):
        wait_state(_spec(balancer, "gone"), taking_new=True, timeout_s=0.5)
    router.status = 200
    assert wait_state(_spec(balancer, "up"), taking_new=True, timeout_s=5) == "UP"


def test_takes_new_reads_haproxy_states() -> None:
    assert [takes_new(s) for s in ("UP", "UP 1/2", "no check", "DOWN", "DOWN 1/2", "DRAIN", "MAINT", "NOLB")] == [
        True, True, True, False, False, False, False, False]
    with pytest.raises(BalancerError, match="did not answer"):
        backend_states(f"http://127.0.0.1:{free_port()}/stats", "routers", timeout_s=1)


def _states(plan: BalancerPlan) -> dict[str, str]:
    try:
        return backend_states(str(plan.stats_url), "routers")
    except BalancerError:
        return {}
