"""HAProxy in front of two routers (issue 28 parts 3 and 4), all real processes under the process-mode supervisor
(`python -m tilepd.deploy.proc`, as `tilepd up` runs them): the stack's vLLM prefill and decode node, two routers,
and HAProxy with the configuration tilepd renders, reached with the official `openai` client.

The balancer health-checks each router's /health and spreads requests over both; a drained router (its /health 503)
is taken out and gets nothing new; a restart the way `tilepd up` restarts a changed router (proc start: drain at the
balancer, wait for its streams, restart, health gate, back UP) under two clients that never pause fails no request;
a SIGKILLed router is marked down and every request after it goes through the other.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from openai import OpenAI

from tilepd.deploy import proc
from tilepd.deploy.balancer import BalancerSpec, backend_states, drain_router, undrain_router, wait_state
from tilepd.connector.launch import free_port
from tilepd.plan.haproxy import FALL, RISE, haproxy_cfg
from tilepd.plan.model import BalancerBackend, BalancerPlan

from .conftest import Stack
from .stack import MODEL_NAME, router_config, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
HAPROXY = "/usr/sbin/haproxy"
CHECK_S = 0.5
ROUTERS = ("a", "b")


def _env() -> dict[str, str]:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    env.update({k: v for k, v in os.environ.items() if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    return env


class Front:
    """The balancer's address, its stats, and the supervisor's specs of the two routers and HAProxy."""

    def __init__(self, stack: Stack) -> None:
        work = stack.workdir / "balancer"
        work.mkdir(exist_ok=True)
        self.work = work
        self.port, stats_port = free_port(), free_port()
        self.routers: dict[str, proc.ServiceSpec] = {}
        backends = []
        for name in ROUTERS:
            cfg = router_config(stack.model, stack.prefill.url, [stack.endpoint], name=f"router-{name}",  # type: ignore[union-attr,list-item]
                                queue_timeout_s=60.0, health_timeout_s=5.0, breaker_failures=3)
            path = work / f"router-{name}.json"
            path.write_text(cfg.model_dump_json())
            backends.append(BalancerBackend(name=name, service=f"router-{name}", address="127.0.0.1", port=cfg.port))
            self.routers[name] = self._spec(f"router-{name}", "router", [sys.executable, "-m", "tilepd.router", "--config", str(path)],
                                            f"http://127.0.0.1:{cfg.port}/health")
        self.plan = BalancerPlan(name="lb", address="127.0.0.1", port=self.port, external=False, stats_port=stats_port,
                                 stats_url=f"http://127.0.0.1:{stats_port}/stats", backend="routers", check_interval_s=CHECK_S,
                                 drain_timeout_s=60.0, request_timeout_s=600.0, backends=backends)
        cfg_file = work / "balancer.cfg"
        cfg_file.write_text(haproxy_cfg(self.plan, "test", "127.0.0.1"))
        self.haproxy = self._spec("balancer", "balancer", [HAPROXY, "-db", "-f", str(cfg_file)],
                                  f"http://127.0.0.1:{self.port}/balancer/health")
        for name, spec in self.routers.items():
            spec.balancer = self.where(name)

    def _spec(self, name: str, role: str, argv: list[str], health: str) -> proc.ServiceSpec:
        return proc.ServiceSpec(name=name, role=role, argv=argv, env=_env(), cwd=self.work, log_file=self.work / f"{name}.log",
                                pid_file=self.work / f"{name}.pid", config_hash="balancer-test-1", health_url=health,
                                health_timeout_s=120)

    def where(self, name: str) -> BalancerSpec:
        return BalancerSpec(stats_url=self.plan.stats_url, backend="routers", server=name, check_interval_s=CHECK_S,
                            checks_to_mark=max(FALL, RISE), drain_timeout_s=60.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def states(self) -> dict[str, str]:
        return backend_states(str(self.plan.stats_url), "routers")

    def served(self, name: str) -> int:
        text = httpx.get(str(self.routers[name].health_url).removesuffix("/health") + "/metrics", timeout=5).text
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("tilepd_router_responses_total{") and 'status="200"' in line))


@pytest.fixture(scope="module")
def front(router_stack: Stack) -> Iterator[Front]:
    if not Path(HAPROXY).exists():
        pytest.skip("haproxy is not installed (scripts/bootstrap.sh installs Debian's package)")
    f = Front(router_stack)
    started = [*f.routers.values(), f.haproxy]
    try:
        for spec in started:
            assert proc.start(spec)["action"] == "start"
            gate = proc.wait_healthy(spec)
            assert gate["healthy"], gate
        assert wait_until(lambda: f.states() == {"a": "UP", "b": "UP"}, 30), f.states()
        yield f
    finally:
        for spec in reversed(started):
            proc.stop(spec)


def _refuses(port: int) -> bool:
    """Nothing listens on 127.0.0.1:`port` any more (a connection is refused)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def _client(front: Front) -> OpenAI:
    return OpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client: OpenAI, i: int, stream: bool = False) -> str:
    messages = [{"role": "user", "content": f"request {i}: count to three"}]
    if not stream:
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
        return r.choices[0].message.content or ""
    text = ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text


def test_the_balancer_spreads_requests_and_a_drained_router_gets_none(front: Front) -> None:
    client = _client(front)
    before = {n: front.served(n) for n in ROUTERS}
    for i in range(6):
        _chat(client, i)
    assert all(front.served(n) > before[n] for n in ROUTERS), (before, {n: front.served(n) for n in ROUTERS})

    base = str(front.routers["a"].health_url).removesuffix("/health")
    assert drain_router(base, None)["draining"] is True
    health = httpx.get(base + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining" and health.json()["in_flight"] == 0
    wait_state(front.where("a"), taking_new=False, timeout_s=15)
    a_before = front.served("a")
    for i in range(4):
        _chat(client, 100 + i)
    assert front.served("a") == a_before  # nothing new reached the drained router
    undrain_router(base, None)
    assert wait_state(front.where("a"), taking_new=True, timeout_s=15) == "UP"


def test_rolling_restart_of_both_routers_under_steady_traffic_fails_nothing(front: Front) -> None:
    stop = threading.Event()
    outcomes: list[str] = []

    def steady(k: int) -> None:
        client = _client(front)
        i = 0
        while not stop.is_set():
            try:
                _chat(client, 1000 * k + i, stream=i % 2 == 0)
                outcomes.append("ok")
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                outcomes.append(f"{type(exc).__name__}: {exc}")
            i += 1

    clients = [threading.Thread(target=steady, args=(k,)) for k in (1, 2)]
    for t in clients:
        t.start()
    try:
        time.sleep(2)
        results = {n: proc.start(front.routers[n], force=True) for n in ROUTERS}
        time.sleep(2)
    finally:
        stop.set()
        for t in clients:
            t.join(120)
    for name, r in results.items():
        assert r["action"] == "restart" and r["healthy"] and not r.get("failed"), (name, r)
        assert r["drain"]["drained"] and r["balancer_state"] == "UP", (name, r)
    failed = [o for o in outcomes if o != "ok"]
    print(f"rolling restart of both routers: {len(outcomes)} requests, {len(failed)} failed; drains: "
          + ", ".join(f"{n} {r['drain']['waited_s']}s" for n, r in results.items()))
    assert len(outcomes) >= 4 and not failed, failed[:5]


def test_a_killed_router_is_marked_down_and_the_other_serves_everything(front: Front) -> None:
    spec = front.routers["b"]
    pid = int(proc.status(spec)["pid"])
    os.killpg(pid, signal.SIGKILL)  # the router and its render workers, at once
    # from its death on, its listening socket closed (a request sent while the kernel tears it down is one in flight on
    # it). The pid's state says nothing of that: its main thread can show zombie while its other threads, exiting,
    # still hold the sockets, and a connection then is accepted and reset (HAProxy's 502 SH): wait for the port to refuse.
    port = urlsplit(str(spec.health_url)).port
    assert port is not None
    assert wait_until(lambda: _refuses(port), 10)
    client = _client(front)
    answers = [_chat(client, 200 + i) for i in range(6)]  # from the kill on: a refused connection is retried on router a
    assert all(isinstance(a, str) for a in answers)
    assert wait_until(lambda: front.states().get("b", "").startswith("DOWN"), 15), front.states()
    assert front.states()["a"] == "UP"
    back = proc.start(spec)
    assert back["action"] in ("start", "recover") and proc.wait_healthy(spec)["healthy"], back
    assert wait_until(lambda: front.states().get("b") == "UP", 15), front.states()
