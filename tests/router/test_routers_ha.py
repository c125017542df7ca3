"""Several routers over the same decode nodes (issue 28 parts 1 and 2): each node arbitrates its own slot.

Real processes: the stack's vLLM prefill, two CPU decode nodes (the stack's allowlisted spares, with a 3 s
reservation lease) and two routers that share nothing but the nodes' answers. The nodes' own logs are the witness:
every reservation a node granted was freed before it granted the next, and every decode it ran lies inside its own
transfer's reservation, so no node ever served two requests at once. A router that finds both nodes held waits on
their slot-free answers (one refused reservation per node, no polling), a router killed while it holds a node
leaves it at the lease deadline, and a router only starved past that deadline keeps it when nobody else asked (the
relay in front of its prefill holds its request there: a fault injector, every byte reaches the real vLLM).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tilepd.connector.launch import Server
from tilepd.contracts.decode_http import NODE_API_VERSION
from tilepd.contracts.service_configs import DecodeEndpoint
from tilepd.runtime.slot import LAPSE_GRACE_LEASES

from tests.slot_log import check_one_at_a_time, slot_events

from .conftest import Stack
from .held_relay import HeldRelay
from .stack import MODEL_NAME, router_config, start_decode_node, stop_all, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LEASE_S = 3.0
CLIENTS_PER_ROUTER = 3
ROUNDS = 2


@pytest.fixture(scope="module")
def nodes(router_stack: Stack) -> Iterator[list[tuple[Server, DecodeEndpoint]]]:
    started = []
    try:
        for ep in router_stack.spares[:2]:
            srv, _ = start_decode_node(router_stack.model, router_stack.workdir, ep.name, endpoint=ep, reservation_lease_s=LEASE_S)
            started.append((srv, ep))
        yield started
    finally:
        stop_all([s for s, _ in started])


@pytest.fixture(scope="module")
def routers(router_stack: Stack, nodes: list[tuple[Server, DecodeEndpoint]], start_router_proc) -> list[str]:  # noqa: ANN001
    """router-a and router-b over both nodes; the queue bound is long: what these tests count is the nodes' arbitration."""
    urls = []
    for name in ("router-a", "router-b"):
        cfg = router_config(router_stack.model, router_stack.prefill.url, [ep for _, ep in nodes], name=name,  # type: ignore[union-attr]
                            queue_timeout_s=60.0, health_interval_s=0.5, health_timeout_s=5.0, breaker_failures=3)
        srv, _ = start_router_proc(cfg)
        urls.append(srv.url)
    for url in urls:
        assert wait_until(lambda: httpx.get(url + "/health", timeout=5).json()["nodes_in_rotation"] == 2, 30), url
    return urls


def _complete(router: str, i: int, max_tokens: int = 6) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": f"request {i}: the quick brown fox", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(router + "/v1/completions", json=body, timeout=300)


def _node_url(ep: DecodeEndpoint) -> str:
    return f"http://127.0.0.1:{ep.http_port}"


def _metric(router: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(router + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and (not labels or "{" + want + "}" in line.replace(", ", ",")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _reserve(ep: DecodeEndpoint, tid: str) -> int:
    r = httpx.post(_node_url(ep) + "/v1/reserve", json={"transfer_id": tid, "token": "t", "holder": "test-holder",
                                                        "node_api": NODE_API_VERSION}, timeout=10)
    assert r.status_code == 200, r.text
    return int(r.json()["fence"])


def test_two_routers_share_two_nodes_and_no_node_holds_two_requests(routers: list[str],
                                                                    nodes: list[tuple[Server, DecodeEndpoint]]) -> None:
    results: list[int] = []

    def client(router: str, k: int) -> None:
        for j in range(ROUNDS):
            results.append(_complete(router, 1000 * k + j).status_code)

    threads = [threading.Thread(target=client, args=(url, i * 10 + c)) for i, url in enumerate(routers) for c in range(CLIENTS_PER_ROUTER)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert results == [200] * (len(routers) * CLIENTS_PER_ROUTER * ROUNDS), results
    holders: set[str] = set()
    for srv, ep in nodes:
        holders |= check_one_at_a_time(srv.log_text())
        assert not httpx.get(_node_url(ep) + "/status", timeout=5).json()["busy"]
    assert {"router-a", "router-b"} <= holders, holders


def test_a_router_that_finds_every_node_held_waits_for_the_slot_free_answer(routers: list[str],
                                                                           nodes: list[tuple[Server, DecodeEndpoint]]) -> None:
    """Both nodes held by another holder: router-a is refused once per node (busy, naming the holder), then waits on
    the nodes' slot-free answers; the moment one node is given back, the waiting request is served there."""
    router = routers[0]
    (_, e1), (_, e2) = nodes
    busy_before = {ep.name: _metric(router, "tilepd_router_reservation_refusals_total", node=ep.name, code="busy") for ep in (e1, e2)}
    fences = {e1.name: _reserve(e1, "tx-test-hold-1"), e2.name: _reserve(e2, "tx-test-hold-2")}
    stop = threading.Event()

    def renew() -> None:  # the test is a living holder: its leases do not run out while the request waits
        while not stop.wait(LEASE_S / 4):
            for ep, tid in ((e1, "tx-test-hold-1"), (e2, "tx-test-hold-2")):
                httpx.post(_node_url(ep) + "/v1/renew", json={"transfer_id": tid, "fence": fences[ep.name]}, timeout=5)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    answer: dict[str, httpx.Response] = {}
    waiting = threading.Thread(target=lambda: answer.update(r=_complete(router, 7)))
    try:
        waiting.start()
        status = lambda: httpx.get(router + "/status", timeout=5).json()  # noqa: E731
        assert wait_until(lambda: [n["held_by"] for n in status()["nodes"]] == ["test-holder"] * 2, 60), status()
        assert status()["queue_depth"] == 1
        httpx.post(_node_url(e2) + "/v1/cancel", json={"transfer_id": "tx-test-hold-2", "fence": fences[e2.name]}, timeout=5)
        waiting.join(120)
        r = answer["r"]
        assert r.status_code == 200 and r.headers["x-tilepd-node"] == e2.name, r.text
    finally:
        stop.set()
        renewer.join(10)
        httpx.post(_node_url(e1) + "/v1/cancel", json={"transfer_id": "tx-test-hold-1"}, timeout=5)
    for ep in (e1, e2):  # one refused reservation per node, then the wait: no polling
        assert _metric(router, "tilepd_router_reservation_refusals_total", node=ep.name, code="busy") == busy_before[ep.name] + 1
    assert wait_until(lambda: all(n["held_by"] is None for n in httpx.get(router + "/status", timeout=5).json()["nodes"]), 30)


def test_a_killed_router_leaves_its_node_at_the_lease_deadline(router_stack: Stack, routers: list[str],
                                                              nodes: list[tuple[Server, DecodeEndpoint]],
                                                              start_router_proc) -> None:  # noqa: ANN001
    """router-c holds a node (its prefill's answer held in the relay: the KV reached the node, no decode joined yet)
    and is SIGKILLed: nothing renews its reservation, which lapses at the lease deadline (the next reservation would
    take it) and is taken back by the node after the grace when nobody took it. A request sent to router-a after the
    kill is served meanwhile."""
    relay = HeldRelay(int(str(router_stack.prefill.url).rsplit(":", 1)[1]), held=b"POST /v1/completions ")  # type: ignore[union-attr]
    cfg = router_config(router_stack.model, f"http://127.0.0.1:{relay.port}", [ep for _, ep in nodes], name="router-c",
                        queue_timeout_s=60.0, health_interval_s=0.5, health_timeout_s=5.0)
    killed, _ = start_router_proc(cfg)
    by_name = {ep.name: (srv, ep) for srv, ep in nodes}
    try:
        with relay.holding():
            threading.Thread(target=lambda: _swallow(lambda: _complete(killed.url, 9)), daemon=True).start()

            def held_by_c() -> str | None:
                for _, ep in nodes:
                    st = httpx.get(_node_url(ep) + "/status", timeout=5).json()
                    if str(st.get("holder") or "").startswith("router-c"):
                        return ep.name
                return None

            assert wait_until(lambda: held_by_c() is not None and relay.held_decodes > 0, 120), "router-c never held a node"
            name = held_by_c()
            assert name is not None
            os.kill(killed.proc.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            srv, ep = by_name[name]
            after = _complete(routers[0], 11)  # served by the other node, or by this one once it is free
            assert after.status_code == 200, after.text
            assert wait_until(lambda: httpx.get(_node_url(ep) + "/status", timeout=5).json()["state"] == "free",
                              LEASE_S * (1 + LAPSE_GRACE_LEASES) + 30)
            freed_after_s = time.monotonic() - t_kill
    finally:
        relay.close()
        _kill_group(killed)
    log = srv.log_text()
    expired = [line for line in log.splitlines() if "event=reservation_expired" in line and "holder=router-c" in line]
    assert len(expired) == 1, log[-3000:]
    print(f"node {name} freed {freed_after_s:.1f}s after router-c's SIGKILL (lease {LEASE_S:g}s): {expired[0]}")
    check_one_at_a_time(log)


def test_a_router_starved_past_its_lease_keeps_the_node_nobody_else_asked_for(router_stack: Stack,
                                                                               nodes: list[tuple[Server, DecodeEndpoint]],
                                                                               start_router_proc) -> None:  # noqa: ANN001
    """router-s holds a node (its prefill's answer held in the relay: the KV reached the node, no decode joined yet) and
    is SIGSTOPped past its lease, as a starved host does to a sleeping process: the reservation lapses (the next
    reservation would take it), nobody asks for the node, and once running again router-s revives it and its request
    is served by that node."""
    relay = HeldRelay(int(str(router_stack.prefill.url).rsplit(":", 1)[1]), held=b"POST /v1/completions ")  # type: ignore[union-attr]
    cfg = router_config(router_stack.model, f"http://127.0.0.1:{relay.port}", [ep for _, ep in nodes], name="router-s",
                        queue_timeout_s=60.0, health_interval_s=0.5, health_timeout_s=5.0)
    starved, _ = start_router_proc(cfg)
    by_name = {ep.name: (srv, ep) for srv, ep in nodes}
    answer: dict[str, httpx.Response] = {}
    client = threading.Thread(target=lambda: answer.update(r=_complete(starved.url, 12)), daemon=True)
    try:
        with relay.holding():
            client.start()

            def held_by_s() -> str | None:
                for _, ep in nodes:
                    if str(httpx.get(_node_url(ep) + "/status", timeout=5).json().get("holder") or "").startswith("router-s"):
                        return ep.name
                return None

            assert wait_until(lambda: held_by_s() is not None and relay.held_decodes > 0, 120), "router-s never held a node"
            name = held_by_s()
            assert name is not None
            srv, ep = by_name[name]
            os.kill(starved.proc.pid, signal.SIGSTOP)
            try:
                status = lambda: httpx.get(_node_url(ep) + "/status", timeout=5).json()  # noqa: E731
                assert wait_until(lambda: status()["lapsed"], LEASE_S + 10), status()
                st = status()
                assert st["state"] != "free" and not st["busy"] and st["holder"].startswith("router-s"), st
            finally:
                os.kill(starved.proc.pid, signal.SIGCONT)
        client.join(120)
        r = answer["r"]
        assert r.status_code == 200 and r.headers["x-tilepd-node"] == name, r.text
    finally:
        relay.close()
        _kill_group(starved)
    log = srv.log_text()
    tid = next(t for kind, t, holder in slot_events(log) if kind == "reserved" and holder.startswith("router-s"))
    mine = [line for line in log.splitlines() if tid in line]
    assert any("event=reservation_lapsed" in line for line in mine), mine
    assert any("event=reservation_revived" in line for line in mine), mine
    assert not any("event=reservation_expired" in line for line in mine), mine
    check_one_at_a_time(log)


def _swallow(call) -> None:  # noqa: ANN001 - the killed router's client sees its connection end
    try:
        call()
    except httpx.HTTPError:
        pass


def _kill_group(srv: Server) -> None:
    """The killed router's render workers live on in its process group: end them."""
    try:
        os.killpg(srv.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    srv.proc.wait(10)


def test_the_nodes_logs_name_each_reservation_holder(nodes: list[tuple[Server, DecodeEndpoint]]) -> None:
    """What an operator greps for: who held the slot, by name, host, port and pid."""
    events = [e for srv, _ in nodes for e in slot_events(srv.log_text()) if e[0] == "reserved"]
    assert events and all(re.fullmatch(r"\S+ \(\S+:\d+, pid \d+\)|test-holder", h) for _, _, h in events), events[:5]
