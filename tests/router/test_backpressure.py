"""Backpressure, client disconnects, auth, body limits and the circuit breaker, on real processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .conftest import Stack
from .stack import MAX_SEQ_LEN, MODEL_NAME, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BODY = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": True}


async def _burst(url: str, n: int) -> list[tuple[int, str, float, dict[str, str], str]]:
    """(status, route, seconds, headers, the body's first 500 characters) of `n` concurrent completions."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one() -> tuple[int, str, float, dict[str, str], str]:
            t0 = time.monotonic()
            r = await client.post(url + "/v1/completions", json=BODY)
            return r.status_code, r.headers.get("x-tilepd-route", ""), time.monotonic() - t0, dict(r.headers), r.text[:500]
        return await asyncio.gather(*(one() for _ in range(n)))


def _all_idle(stack: Stack, router_url: str) -> bool:
    status = httpx.get(router_url + "/status").json()
    node = httpx.get(stack.decode_url + "/status").json()
    return status["queue_depth"] == 0 and not any(n["leased"] for n in status["nodes"]) and not node["busy"]




# native-fallback: 19 requests reach ONE native vLLM decode at once. On a 2-core box its first NIXL
# handshake or KV pulls can time out; the planner's `kv_load_failure_policy: recompute` turns
# those into local recomputes (slow, but 200s) instead of vLLM's default 500s, and the router
# retries upstream TCP connects that time out on the saturated box (it used to answer 502).
# Both fixed 2026-11-29; it passed in every run since: 4 alone, 1 in tests/router, 1 in the full suite.


@pytest.mark.parametrize("native", [False, True], ids=["429", "native-fallback"])
def test_twenty_concurrent_requests_one_node(router_stack: Stack, plain_router: tuple[str, Any], native_router: tuple[str, Any],
                                             native: bool) -> None:
    url, cfg = native_router if native else plain_router
    assert cfg.queue_timeout_s == 2.0 and len(cfg.decode_nodes) == 1
    results = asyncio.run(_burst(url, 20))
    codes = [r[0] for r in results]
    assert codes.count(200) >= 1
    for status, route, elapsed, headers, text in results:
        if status == 429:
            assert not native and headers.get("retry-after") == "1"
            assert elapsed < cfg.queue_timeout_s + 3.0  # answered within the bound, never hung
        else:
            assert status == 200, (status, route, headers.get("x-tilepd-route-reason"), round(elapsed, 1), text)
            assert route == "low_latency" or (native and headers["x-tilepd-route-reason"] == "busy")
    if native:
        assert any(r[1] == "native" for r in results)
    else:
        assert 429 in codes
    assert wait_until(lambda: _all_idle(router_stack, url)), "a lease leaked"


def test_client_dropping_mid_stream_cancels_the_decode(router_stack: Stack, plain_router: tuple[str, Any]) -> None:
    url, _ = plain_router
    body = {**BODY, "max_tokens": 600, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert all(g.startswith("data: ") or g == "" for g in got)
            assert httpx.get(router_stack.decode_url + "/status").json()["state"] == "decoding"
            dropped = time.monotonic()
    # leaving the block closed the connection mid-stream: the node is freed by a cancel, not by the
    # decode running out (the proof is the token count, which no machine's speed changes)
    assert wait_until(lambda: not httpx.get(router_stack.decode_url + "/status").json()["busy"], 10.0)
    freed_s = time.monotonic() - dropped
    decoded = httpx.get(router_stack.decode_url + "/status").json()["last"]["tokens"]
    assert decoded < 300, f"the node decoded {decoded} of 600 tokens ({freed_s:.2f} s) after the client left: not cancelled"
    assert wait_until(lambda: _all_idle(router_stack, url), 5.0)
    again = httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


def test_client_dropping_a_non_streamed_request_cancels_the_decode(router_stack: Stack, plain_router: tuple[str, Any]) -> None:
    """A plain socket sends the request, waits until the node decodes, then closes: the router must notice with no body to write."""
    url, _ = plain_router
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({**BODY, "max_tokens": 1000}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        assert wait_until(lambda: httpx.get(router_stack.decode_url + "/status").json()["state"] == "decoding", 30.0)
    dropped = time.monotonic()
    assert wait_until(lambda: not httpx.get(router_stack.decode_url + "/status").json()["busy"], 10.0)
    freed_s = time.monotonic() - dropped
    decoded = httpx.get(router_stack.decode_url + "/status").json()["last"]["tokens"]
    assert decoded < 500, f"the node decoded {decoded} of 1000 tokens ({freed_s:.2f} s) after the client left: not cancelled"
    assert wait_until(lambda: _all_idle(router_stack, url), 5.0)
    assert any("outcome=disconnected" in p.read_text() for p in Path(router_stack.workdir).glob("router-*.log"))


def test_api_keys_and_body_limit(router_stack: Stack, start_router_proc: Callable[..., Any], tmp_path: Any) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-file\n")
    cfg = router_stack.config(native=False, api_key_env="TILEPD_TEST_ROUTER_KEY", api_key_file=key_file, max_body_bytes=2048)
    srv, _ = start_router_proc(cfg, env={"TILEPD_TEST_ROUTER_KEY": "sk-env"})
    small = {**BODY, "max_tokens": 2}
    refused = httpx.post(srv.url + "/v1/completions", json=small, headers={"x-request-id": "req-no-key"})
    assert refused.status_code == 401
    assert (refused.headers["x-tilepd-route"], refused.headers["x-request-id"]) == ("none", "req-no-key")
    assert httpx.post(srv.url + "/v1/completions", json=small, headers={"authorization": "Bearer wrong"}).status_code == 401
    for key in ("sk-env", "sk-file"):
        r = httpx.post(srv.url + "/v1/completions", json=small, headers={"authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
    big = {**small, "prompt": "x" * 4096}
    r = httpx.post(srv.url + "/v1/completions", json=big, headers={"authorization": "Bearer sk-env"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert httpx.get(srv.url + "/health").status_code == 200  # health and metrics stay open for probes
    assert httpx.get(srv.url + "/v1/models").status_code == 401


def test_unhealthy_node_leaves_rotation_and_is_probed_back(router_stack: Stack, native_router: tuple[str, Any]) -> None:
    """SIGSTOP makes the real node miss its health checks (no fake needed); SIGCONT brings it back."""
    url, cfg = native_router
    assert router_stack.decode is not None
    pid = router_stack.decode.proc.pid
    opened_before = _breaker_opens(url)
    # the router needs breaker_failures probes in a row to fail, each after health_timeout_s at most
    detect_s = cfg.breaker_failures * (cfg.health_timeout_s + cfg.health_interval_s) + 5.0
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: not httpx.get(url + "/status").json()["nodes"][0]["in_rotation"], detect_s)
        # What is checked is the routing decision, which the response headers carry: streamed, they arrive once the
        # native prefill answered and the native decode accepted the request, not after its (slow on CPU: it
        # recomputes, issue 13 part 8) tokens; leaving the block drops the request.
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url + "/v1/completions", json={**BODY, "max_tokens": 4, "stream": True}) as r:
                assert r.status_code == 200
                assert (r.headers["x-tilepd-route"], r.headers["x-tilepd-route-reason"]) == ("native", "no_node_in_rotation")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: httpx.get(url + "/status").json()["nodes"][0]["in_rotation"], 10.0)
    # the first request after it may still go native if a queued probe fails (the flapping below); the node must
    # serve one within the deadline, or it never really came back
    routes: list[str] = []

    def served_low_latency() -> bool:
        with httpx.Client(timeout=60) as client:  # streamed: the route is in the headers; a native one is dropped there
            with client.stream("POST", url + "/v1/completions", json={**BODY, "max_tokens": 4, "stream": True}) as r:
                routes.append(f"{r.status_code} {r.headers.get('x-tilepd-route')}")
                if r.status_code != 200 or r.headers["x-tilepd-route"] != "low_latency":
                    return False
                return b"".join(r.iter_bytes()).endswith(b"data: [DONE]\n\n")

    assert wait_until(served_low_latency, 30.0), routes
    # this router also served the earlier tests: count the transitions this test caused. More than one can be
    # right: a node continued after SIGSTOP first drains the probe connections that queued in its backlog while it
    # was stopped, and on a loaded box the next probes can time out meanwhile (seen at load 30: open, close, open, close)
    assert _breaker_opens(url) >= opened_before + 1


def _breaker_opens(router_url: str) -> float:
    prefix = 'tilepd_router_breaker_transitions_total{node="d0",state="open"} '
    lines = [line for line in httpx.get(router_url + "/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix):]) if lines else 0.0


def test_router_shutdown_mid_stream_frees_the_node(router_stack: Stack, start_router_proc: Callable[..., Any],
                                                  plain_router: tuple[str, Any]) -> None:
    """SIGTERM while a decode streams: the router cancels it on the way down; the node is free and serves again.

    The race this test lost: it asked the node's /status whether it was busy, which a CPU node answers from the
    event loop its decoding thread starves, so the answer came after the decode had finished. Now it asks the
    router (a process of its own) and checks what must hold however the race goes: the router held the node
    when the client had four events; it stops cleanly, cancelling any decode it still holds
    (`cancelled_decodes` 0 or 1: a node on an idle box can finish 1000 tokens before SIGTERM lands, and the
    router's graceful shutdown may let the stream end); the node is free within 5 s and serves again."""
    srv, _ = start_router_proc(router_stack.config(native=False))
    body = {**BODY, "max_tokens": MAX_SEQ_LEN - 16, "stream": True}  # the prompt is under 16 tokens
    host, port = srv.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window is small from the start
        sock.settimeout(60)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        got = b""
        while got.count(b"data: ") < 4:
            chunk = sock.recv(1024)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        held = httpx.get(srv.url + "/status").json()["nodes"][0]
        os.killpg(srv.proc.pid, signal.SIGTERM)
        srv.proc.wait(30)
    assert held["leased"] and held["transfer_id"], held
    router_log = srv.log_text()
    stopped = re.search(r"event=stopped cancelled_decodes=(\d+)", router_log)
    assert stopped and int(stopped.group(1)) in (0, 1), router_log[-2000:]
    assert wait_until(lambda: not httpx.get(router_stack.decode_url + "/status").json()["busy"], 5.0)
    again = httpx.post(plain_router[0] + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
