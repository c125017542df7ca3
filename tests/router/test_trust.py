"""Issue 26's smaller router findings, on real router processes: client-chosen keys in labels and headers, API key
rotation, and a hand-off the prefill's connector refused."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tilepd.connector.launch import free_port

from .conftest import Stack
from .stack import MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SMALL = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}


def test_a_non_latin1_key_is_refused_by_name_not_with_a_500(plain_router: tuple[str, Any], native_router: tuple[str, Any]) -> None:
    """The key becomes `unsupported:<key>`, which went out as a header: a key outside latin-1 made the router 500."""
    r = httpx.post(plain_router[0] + "/v1/completions", json={**SMALL, "ключ": 1}, timeout=60)
    assert r.status_code == 501, r.text
    assert r.json()["error"]["param"] == "ключ"  # the body names the client's key exactly
    assert r.headers["x-tilepd-route-reason"] == "unsupported:other"
    r = httpx.post(native_router[0] + "/v1/completions", json={**SMALL, "ключ": 1}, timeout=120)
    assert (r.status_code, r.headers["x-tilepd-route"], r.headers["x-tilepd-route-reason"]) == (200, "native", "unsupported:other")


def test_client_chosen_keys_add_no_metric_series(plain_router: tuple[str, Any]) -> None:
    url = plain_router[0]
    keys = [f"made-up-key-{i}-{time.monotonic_ns()}" for i in range(20)]
    for key in keys:
        assert httpx.post(url + "/v1/completions", json={**SMALL, key: 1}, timeout=60).status_code == 501
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert not any(key in metrics for key in keys)
    other = [line for line in metrics.splitlines() if line.startswith("tilepd_router_routes_total{") and 'reason="unsupported:other"' in line]
    assert other and float(other[0].rsplit(" ", 1)[1]) >= len(keys), other
    # a parameter the router knows by name keeps its own label
    assert httpx.post(url + "/v1/completions", json={**SMALL, "logit_bias": {"5": 1}}, timeout=60).headers[
        "x-tilepd-route-reason"] == "unsupported:logit_bias"


@pytest.mark.parametrize("content", ["sk-old,sk-new\n", "sk-old\nsk-new\n"], ids=["comma", "lines"])
def test_a_key_file_with_the_old_and_the_new_key_lets_both_in(router_stack: Stack, start_router_proc: Callable[..., Any],
                                                               tmp_path: Any, content: str) -> None:
    """Rotation (README): the file holds both keys while clients move over. `old,new` on one line was read as one key."""
    key_file = tmp_path / "keys"
    key_file.write_text(content)
    srv, _ = start_router_proc(router_stack.config(native=False, api_key_file=key_file))
    for key in ("sk-old", "sk-new"):
        r = httpx.post(srv.url + "/v1/completions", json=SMALL, headers={"authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, (key, r.text)
    for wrong in ("sk-old,sk-new", "sk-other"):
        assert httpx.post(srv.url + "/v1/completions", json=SMALL, headers={"authorization": f"Bearer {wrong}"}).status_code == 401


@pytest.mark.parametrize("native", [False, True], ids=["no-native", "native"])
def test_a_refused_handoff_is_not_waited_for(router_stack: Stack, start_router_proc: Callable[..., Any], native: bool) -> None:
    """The router names the node by a control port the prefill's allowlist lacks (its HTTP port is the real node's, so
    it is healthy and in rotation): the connector refuses the hand-off and says so in `tilepd_handoff`. The router
    used to open the decode anyway, and the node waited KV_WAIT_S (30 s) for a KV that never came."""
    assert router_stack.endpoint is not None
    unlisted = router_stack.endpoint.model_copy(update={"ctrl_port": free_port()})
    srv, _ = start_router_proc(router_stack.config(native=native, decode_nodes=(unlisted,)))
    before = httpx.get(router_stack.decode_url + "/status", timeout=10).json()["transfers_total"]
    r = httpx.post(srv.url + "/v1/completions", json=SMALL, headers={"x-request-id": "req-refused-handoff"}, timeout=120)
    if native:
        assert (r.status_code, r.headers["x-tilepd-route"], r.headers["x-tilepd-route-reason"]) == (200, "native", "handoff_refused"), r.text
    else:
        assert r.status_code == 502 and r.headers["x-tilepd-route-reason"] == "handoff_refused", r.text
        err = r.json()["error"]
        assert err["code"] == "handoff_refused" and "not in the allowlist" in err["message"], err
    assert httpx.get(router_stack.decode_url + "/status", timeout=10).json()["transfers_total"] == before  # never asked
    status = httpx.get(srv.url + "/status", timeout=10).json()["nodes"][0]
    assert not status["leased"] and status["in_rotation"], status
    assert "req=req-refused-handoff event=handoff_refused node=d0" in srv.log_text()
