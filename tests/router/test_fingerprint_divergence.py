"""A decode node that drifted from the prefill, on the real stack (vLLM CPU prefill with the connector, tcp, real
decode nodes, the router), the two ways issue 27 names:

- node `other` holds weights converted from another checkpoint of the same shapes (the tiny Llama with seed 1; the
  prefill serves seed 0): the router's request goes to the native pool with the reason `fingerprint_mismatch`, and a
  marked request sent to the prefill directly is refused by the node at the hello, both fingerprints in the message,
  before any byte moves;
- node `perturbed` holds the prefill's own checkpoint but scales one layer's weights once loaded (the test-only
  fault TILEPD_FAULT_SCALE_WEIGHTS, tilepd.runtime.faults): its canary fails naming the first diverging token and both
  logprobs while the stack's own node passes, and the router's divergence watch drains it from its first probes.

Both nodes run on the stack's spare endpoints (in the prefill's allowlist).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from tilepd.connector.launch import Server
from tilepd.contracts.fingerprint import checkpoint_identity
from tilepd.contracts.service_configs import DivergenceWatchConfig
from tilepd.deploy.canary import CanarySpec, run_canary
from tilepd.dev.tiny_model import make_tiny_model
from tilepd.runtime.faults import SCALE_WEIGHTS_ENV
from tilepd.weights.convert import convert_weights

from .conftest import Stack
from .stack import MODEL_NAME, start_decode_node, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PERTURBATION = "layers.1.=0.5"  # every weight of the second layer halved: same shapes, same fingerprint, other numerics
WATCH = DivergenceWatchConfig(sample_rate=1.0, interval_s=3.0, diverged_checks=2, probe_tokens=8)


@pytest.fixture(scope="module")
def drifted(router_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    work = tmp_path_factory.mktemp("drifted")
    other_ckpt = make_tiny_model("llama", work / "seed1-hf", seed=1)
    other_weights = work / "seed1-weights"
    convert_weights(other_ckpt, other_weights, dtype="fp32", progress=False)  # the node reads the manifest's source identity
    started: list[Server] = []
    try:
        other, other_ep = start_decode_node(other_weights, router_stack.workdir, endpoint=router_stack.spares[0])
        started.append(other)
        perturbed, perturbed_ep = start_decode_node(router_stack.model, router_stack.workdir, endpoint=router_stack.spares[1],
                                                    env={SCALE_WEIGHTS_ENV: PERTURBATION})
        started.append(perturbed)
        yield SimpleNamespace(other=other, other_ep=other_ep, perturbed=perturbed, perturbed_ep=perturbed_ep,
                              prefill_id=checkpoint_identity(router_stack.model).id, other_id=checkpoint_identity(other_ckpt).id)
    finally:
        for srv in reversed(started):
            srv.stop()


def _url(ep) -> str:  # noqa: ANN001 - a DecodeEndpoint
    return f"http://{ep.host}:{ep.http_port}"


def _node_status(ep) -> dict:  # noqa: ANN001
    return httpx.get(_url(ep) + "/status", timeout=10).json()


def test_a_node_of_another_checkpoint_is_skipped_for_the_native_pool(router_stack: Stack, drifted: SimpleNamespace,
                                                                     start_router_proc) -> None:  # noqa: ANN001
    assert _node_status(drifted.other_ep)["fingerprint"]["id"] == drifted.other_id != drifted.prefill_id
    srv, _ = start_router_proc(router_stack.config(native=True, queue_timeout_s=10.0, decode_nodes=(drifted.other_ep,)))
    try:
        assert wait_until(lambda: httpx.get(srv.url + "/status", timeout=10).json()["nodes"][0]["fingerprint"] == drifted.other_id, 30)
        body = {"model": MODEL_NAME, "prompt": "the fingerprint test", "max_tokens": 6, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
    finally:  # the spare endpoints serve other modules' nodes next: no router of this module may poll them then
        srv.stop()
    assert r.status_code == 200, r.text
    assert r.headers["x-tilepd-route"] == "native" and r.headers["x-tilepd-route-reason"] == "fingerprint_mismatch", dict(r.headers)
    assert r.json()["usage"]["completion_tokens"] == 6
    refused = [line for line in srv.log_text().splitlines() if "event=handoff_refused" in line]
    assert refused and drifted.prefill_id in refused[-1] and drifted.other_id in refused[-1], refused
    assert _node_status(drifted.other_ep)["transfers_total"] == 0  # the claim was refused: no hello, no byte


def test_the_node_refuses_a_hello_of_another_checkpoint_naming_both(router_stack: Stack, drifted: SimpleNamespace) -> None:
    """A marked request without the router's view of the node (a stale router, a hand-made request): the node's own
    check at the hello refuses it before any byte moves, and both logs name both fingerprints."""
    ep = drifted.other_ep
    assert router_stack.prefill is not None
    marker = {"tilepd": {"host": ep.host, "ctrl_port": ep.ctrl_port, "transfer_id": "tx-other-ckpt", "token": "t0k3n"}}
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 1, "logprobs": 1, "temperature": 0, "kv_transfer_params": marker}
    r = httpx.post(router_stack.prefill.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text

    def refusal() -> list[str]:
        return [line for line in drifted.other.log_text().splitlines() if "event=hello_refused" in line and "fingerprint_mismatch" in line]

    assert wait_until(lambda: bool(refusal()), 60), drifted.other.log_text()[-3000:]
    line = refusal()[-1]
    assert drifted.prefill_id in line and drifted.other_id in line and "runbook=RB-fingerprint-mismatch" in line, line
    assert re.search(r"differ in weights", line), line

    def failed() -> list[str]:  # the prefill's worker logs it as the refusal comes back, a few ms after the node's line
        return [ln for ln in router_stack.prefill.log_text().splitlines() if "tx-other-ckpt" in ln and "event=failed" in ln]

    assert wait_until(lambda: bool(failed()), 30), router_stack.prefill.log_text()[-3000:]
    last = failed()[-1]
    assert "code=fingerprint_mismatch" in last and drifted.other_id in last, last
    st = _node_status(ep)
    assert st["transfers_total"] == 0 and st["bytes_total"] == 0


def _canary(router_stack: Stack, ep) -> dict:  # noqa: ANN001
    assert router_stack.prefill is not None
    spec = CanarySpec(node=ep.name, prefill_urls=[router_stack.prefill.url], model=MODEL_NAME, ctrl_host=ep.host, ctrl_port=ep.ctrl_port)
    return run_canary(spec, _url(ep), None).as_json()


def test_the_canary_fails_a_perturbed_engine_and_passes_the_sound_one(router_stack: Stack, drifted: SimpleNamespace) -> None:
    sound = _canary(router_stack, router_stack.endpoint)
    assert sound["outcome"] == "ok" and sound["verdict"]["ok"] and sound["verdict"]["checked"] == 16, sound
    bad = _canary(router_stack, drifted.perturbed_ep)
    assert bad["outcome"] == "failed" and not bad["verdict"]["ok"], bad
    first = bad["verdict"]["first_divergence"]
    assert first["top_logprob"] - first["logprob"] > bad["verdict"]["margin"]
    assert f"diverges at token {first['index']}" in bad["reason"] and f"logprob {first['logprob']:.3f}" in bad["reason"]
    assert f"logprob {first['top_logprob']:.3f}" in bad["reason"] and "RB-divergence" in bad["reason"]


def test_the_watch_drains_the_perturbed_node_and_keeps_the_sound_one(router_stack: Stack, drifted: SimpleNamespace,
                                                                       start_router_proc) -> None:  # noqa: ANN001
    sound, bad = router_stack.endpoint, drifted.perturbed_ep
    assert sound is not None
    srv, _ = start_router_proc(router_stack.config(native=True, queue_timeout_s=10.0, decode_nodes=(sound, bad), divergence_watch=WATCH))

    def watch() -> dict:
        return httpx.get(srv.url + "/status", timeout=10).json()["divergence"]

    try:
        # a request whose client asks for the check: its verdict is in /status under its request id, whichever node served it
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "watch me", "max_tokens": 8, "temperature": 0},
                       headers={"x-tilepd-verify": "1", "x-request-id": "req-asked"}, timeout=300)
        assert r.status_code == 200 and r.headers["x-tilepd-route"] == "low_latency", r.text
        assert wait_until(lambda: any(c["request_id"] == "req-asked" for c in watch()["recent"]), 60), watch()
        asked = next(c for c in watch()["recent"] if c["request_id"] == "req-asked")
        assert asked["verdict"]["ok"] is (asked["node"] == sound.name), asked

        # with no more traffic, the watch's probes reach the perturbed node and drain it after 2 diverged checks in a row
        assert wait_until(lambda: watch()["nodes"][bad.name]["drained"] is not None, 120), watch()
        w = watch()
        mine = [c for c in w["recent"] if c["node"] == bad.name]
        assert w["nodes"][bad.name]["diverged_in_a_row"] == 2 and all(not c["verdict"]["ok"] for c in mine), mine
        assert any(c["source"] == "probe" for c in mine)
        health = httpx.get(_url(bad) + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        assert "divergence watch" in health.json()["reason"] and "diverges at token" in health.json()["reason"]
        assert _node_status(bad)["drain_reason"] == health.json()["reason"]
        node_row = next(n for n in httpx.get(srv.url + "/status", timeout=10).json()["nodes"] if n["name"] == bad.name)
        assert node_row["draining"] and not node_row["leased"]

        # the sound node is probed too, agrees, and stays in rotation
        assert wait_until(lambda: watch()["nodes"][sound.name]["checks"] >= 1, 60), watch()
        assert watch()["nodes"][sound.name]["diverged"] == 0 and watch()["nodes"][sound.name]["drained"] is None
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert re.search(rf'tilepd_router_divergence_checks_total{{node="{bad.name}",verdict="diverged"}} [2-9]', metrics), metrics
        assert re.search(rf'tilepd_router_divergence_checks_total{{node="{sound.name}",verdict="agree"}} [1-9]', metrics)
        gap = re.search(rf'tilepd_router_divergence_worst_gap_nats{{node="{bad.name}"}} (\S+)', metrics)
        assert gap and float(gap.group(1)) > WATCH.margin_nats
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "after", "max_tokens": 4, "temperature": 0},
                       timeout=300)
        assert r.status_code == 200 and r.headers.get("x-tilepd-node") in (None, sound.name)
    finally:  # the spare endpoints serve other modules' nodes next (test_drain_rolling): the watch must not probe them
        srv.stop()
        httpx.post(_url(bad) + "/admin/undrain", timeout=10)
