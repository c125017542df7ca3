"""Drain and undrain of a decode node: the request holding the slot finishes, new ones are refused as draining.

The slot rules run without a node; the live test drives a real `python -m tilepd.runtime` (tiny Llama, CPU,
a deployment secret) through tilepd.deploy.drain, the client `tilepd drain` and the supervisor use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.conftest import start_node, stop_node, wire_payload
from tests.runtime.hf_engine import hf_greedy, hf_prefill_kv
from tests.runtime.test_decode_server import PROMPTS, _fences, _handoff, _layout, _reserve
from tilepd import auth
from tilepd.control.sender import KVSender
from tilepd.deploy import drain as dr
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tests.reserved import reserve_and_attach
from tilepd.runtime.slot import Slot, SlotError, State
from tilepd.transport import Buffer

SECRET = "c3" * 32


def test_a_draining_slot_takes_no_new_transfer_but_keeps_its_own() -> None:
    slot = Slot()
    slot.draining = True
    with pytest.raises(SlotError) as refused:
        slot.reserve("tx-new", "t")
    assert refused.value.code == "draining" and slot.state == State.FREE
    with pytest.raises(SlotError) as admit:
        slot.admit("tx-new", "t", 4, 1, 64, None, conn_id=1)
    assert admit.value.code == "busy" and "draining" in admit.value.message and slot.state == State.FREE
    slot.draining = False
    held = reserve_and_attach(slot, "tx-held", "t")
    slot.draining = True  # drained while the request waits for its KV: the admit of that transfer joins it
    with pytest.raises(SlotError) as other:
        slot.reserve("tx-other", "t")  # a busy draining node says draining, not busy: go elsewhere, do not wait
    assert other.value.code == "draining"
    assert slot.admit("tx-held", "t", 4, 1, 64, None, conn_id=1) > 0 and slot.current is held
    slot.release(held)
    with pytest.raises(SlotError):
        slot.reserve("tx-after", "t")


def test_the_drain_client_names_what_went_wrong(tmp_path: Path) -> None:
    from tilepd.connector.launch import free_port
    from tilepd.plan.builder import DEPLOYMENT_SECRET_ENV

    assert dr.DEPLOYMENT_SECRET_ENV == DEPLOYMENT_SECRET_ENV  # one variable, named in two places
    port = free_port()
    with pytest.raises(dr.DrainError) as exc:
        dr.drain(f"http://127.0.0.1:{port}", None, timeout_s=1, node="decode-x")
    assert exc.value.kind == "unreachable" and "decode-x" in str(exc.value) and str(port) in str(exc.value)
    assert dr.secret_from(None) is None  # a node without a secret (dev run)
    with pytest.raises(auth.SecretFileError, match=f"missing: No such file.*nor is \\${DEPLOYMENT_SECRET_ENV} set"):
        dr.secret_from(tmp_path / "missing", environ={})
    assert dr.secret_from(tmp_path / "missing", environ={DEPLOYMENT_SECRET_ENV: SECRET}) == SECRET.encode()


REPO = Path(__file__).resolve().parents[2]


def _topology(tmp: Path, http_port: int) -> Path:
    """The local example with its base_dir under tmp and decode node d0 on `http_port` (where the test's node listens)."""
    text = (REPO / "topology_examples" / "local.yaml").read_text()
    text = text.replace("~/.local/state/tilepd/local", str(tmp / "base")).replace("http_port: 18557", f"http_port: {http_port}")
    path = tmp / "topology.yaml"
    path.write_text(text)
    return path


def _secret_file(tmp: Path) -> Path:
    """The deployment secret where the plan of _topology puts it (so `tilepd drain` reads the node's own file)."""
    path = tmp / "base" / "secrets" / "deployment"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(SECRET + "\n")
    return path


def _cli(*args: str, secret_env: str | None = None) -> subprocess.CompletedProcess[str]:
    """`tilepd ARGS` from this checkout; $TILEPD_DEPLOYMENT_SECRET only when given."""
    env = {k: v for k, v in os.environ.items() if k != "TILEPD_DEPLOYMENT_SECRET"}
    env["PYTHONPATH"] = str(REPO)
    if secret_env is not None:
        env["TILEPD_DEPLOYMENT_SECRET"] = secret_env
    return subprocess.run([sys.executable, "-m", "tilepd", *args], capture_output=True, text=True, timeout=120, env=env)


def test_drain_cli_names_the_node_the_secret_and_the_address(tmp_path: Path) -> None:
    from tilepd.connector.launch import free_port
    from tilepd.contracts.exit_codes import ExitCode

    port = free_port()
    topo = _topology(tmp_path, port)
    unknown = _cli("drain", str(topo), "d9")
    assert unknown.returncode == ExitCode.USAGE and "no decode node 'd9'" in unknown.stderr and "d0" in unknown.stderr
    no_secret = _cli("drain", str(topo), "d0")
    assert no_secret.returncode == ExitCode.INPUT, no_secret.stderr
    assert f"{tmp_path}/base/secrets/deployment" in no_secret.stderr and "TILEPD_DEPLOYMENT_SECRET" in no_secret.stderr
    down = _cli("undrain", str(topo), "decode-d0", secret_env=SECRET)
    assert down.returncode == ExitCode.UNREACHABLE and f"127.0.0.1:{port}" in down.stderr, down.stderr


def _admit_once(node, model, prompt, tid: str, token: str):
    """The connector's admit + KV write, with one busy retry only (a draining node refuses the admit as busy)."""
    layout = _layout(model)
    first, layers = hf_prefill_kv(model, prompt)
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=node.ctrl_port, http_port=1),),
                               transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=512, busy_retries=1)
    sender = KVSender(cfg, layout, Buffer.from_array(wire_payload(layers, layout)))
    nb = layout.blocks_for(len(prompt))
    try:
        return first, sender.send(("127.0.0.1", node.ctrl_port), tid, token, len(prompt), nb,
                                  [l * nb * layout.block_bytes for l in range(layout.num_layers)])
    finally:
        sender.close()


@pytest.mark.slow
def test_drain_finishes_the_request_in_flight_refuses_new_ones_and_undrain_restores(python_exe: str, tiny_llama: Path, hf_llama,
                                                                                    tmp_path: Path) -> None:
    s = SECRET.encode()
    node = start_node(python_exe, tiny_llama, tmp_path, secret_file=_secret_file(tmp_path), kv_timeout_s=60)
    topo = _topology(tmp_path, int(node.http.rsplit(":", 1)[1]))
    router = auth.node_auth_header(s)
    prompt = PROMPTS["multi_block"]

    def body(tid: str, first: int = 5, **kw: object) -> dict:
        return {"transfer_id": tid, "token": auth.transfer_token(s, tid), "fence": _fences.get(tid, 0), "first_token": first,
                "prompt_tokens": len(prompt), "max_tokens": 8, "ignore_eos": True, "stream": False, "kv_timeout_s": 60, **kw}

    try:
        with node.client() as c:
            # only the router's key may drain
            assert c.post("/admin/drain").status_code == 401 and c.post("/admin/drain", headers={"Authorization": "Bearer x"}).status_code == 401
            assert c.get("/health").json()["status"] == "ok"

            # a request in flight: its decode call holds the slot and waits for the KV
            answer: dict = {}
            first_ref = hf_greedy(hf_llama, prompt, 9)
            _reserve(node, "tx-held", auth.transfer_token(s, "tx-held"), router)
            inflight = threading.Thread(target=lambda: answer.update(r=httpx.post(
                node.http + "/v1/decode", headers=router, json=body("tx-held", first_ref[0]), timeout=120)))
            inflight.start()
            deadline = time.monotonic() + 30
            while not c.get("/status").json()["decode_joined"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.get("/status").json()["transfer_id"] == "tx-held"

            # `tilepd drain`, its key from the node's secret file: still busy at the timeout -> exit 10, node draining
            cli = _cli("drain", str(topo), "d0", "--timeout", "0.3", "--json")
            assert cli.returncode == 10, cli.stdout + cli.stderr
            started = json.loads(cli.stdout)
            assert started["draining"] and not started["idle"] and started["transfer_id"] == "tx-held"
            health = c.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "draining", "idle": False, "reason": None}
            assert c.get("/status").json()["draining"] is True
            # a new request: 503 draining before any KV; its admit is refused as busy; the held one is untouched
            refused = c.post("/v1/decode", headers=router, json=body("tx-new"))
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
            refused = c.post("/v1/reserve", headers=router, json={"transfer_id": "tx-new", "token": auth.transfer_token(s, "tx-new"),
                                                                  "holder": "router-b", "node_api": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
            _, sent = _admit_once(node, hf_llama, prompt, "tx-new2", auth.transfer_token(s, "tx-new2"))
            assert not sent.ok and sent.code == "busy" and "draining" in sent.message
            assert c.get("/status").json()["transfer_id"] == "tx-held"

            # the held request's KV arrives (its admit joins the reserved slot): it decodes to the end, exactly
            first = _handoff(node, hf_llama, prompt, "tx-held", token=auth.transfer_token(s, "tx-held"))
            inflight.join(60)
            r = answer["r"]
            assert r.status_code == 200, r.text
            assert [first] + r.json()["tokens"] == first_ref and r.json()["finish_reason"] == "length"

            done = dr.drain(node.http, s, timeout_s=30, node="decode-t")  # idle now, and stays so
            assert done.draining and done.idle
            cli = _cli("drain", str(topo), "d0", "--json")
            assert cli.returncode == 0 and json.loads(cli.stdout)["idle"] is True, cli.stdout + cli.stderr
            assert c.get("/health").json() == {"status": "draining", "idle": True, "reason": None}
            assert "tilepd_decode_draining 1.0" in c.get("/metrics").text

            cli = _cli("undrain", str(topo), "d0", "--json")
            assert cli.returncode == 0, cli.stderr
            back = json.loads(cli.stdout)
            assert not back["draining"] and back["idle"]
            assert c.get("/health").status_code == 200 and "tilepd_decode_draining 0.0" in c.get("/metrics").text
            first = _handoff(node, hf_llama, prompt, "tx-after", token=auth.transfer_token(s, "tx-after"), headers=router)
            r = c.post("/v1/decode", headers=router, json=body("tx-after", first))
            assert r.status_code == 200 and [first] + r.json()["tokens"] == first_ref, r.text
    finally:
        stop_node(node)
    text = node.log.read_text()
    assert "event=drain " in text and "event=undrain" in text


@pytest.mark.slow
def test_a_drained_node_restarts_drained_and_takes_only_a_canary(python_exe: str, tiny_llama: Path, hf_llama, tmp_path: Path) -> None:
    """The drained state outlives the process (its drain_file), so a node `up` drains and restarts comes back out of
    rotation; an ordinary request is refused, the canary's transfer (tilepd.deploy.canary) decodes exactly; undrain
    clears the file."""
    flag = tmp_path / "run" / "decode-t.drained"
    node = start_node(python_exe, tiny_llama, tmp_path, drain_file=flag)
    try:
        assert not flag.exists()
        assert dr.drain(node.http, None, timeout_s=10, node="decode-t").idle
        assert flag.exists()
    finally:
        stop_node(node)
    node = start_node(python_exe, tiny_llama, tmp_path, drain_file=flag)
    prompt = PROMPTS["multi_block"]
    try:
        with node.client() as c:
            assert c.get("/health").json() == {"status": "draining", "idle": True, "reason": None}
            plain = {"transfer_id": "tx-plain", "token": "tok", "first_token": 5, "prompt_tokens": len(prompt), "max_tokens": 8,
                     "ignore_eos": True, "stream": False}
            refused = c.post("/v1/reserve", json={"transfer_id": "tx-plain", "token": "tok", "holder": "router", "node_api": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
            canary = f"{auth.CANARY_TRANSFER_PREFIX}1"
            first = _handoff(node, hf_llama, prompt, canary)
            r = c.post("/v1/decode", json={**plain, "transfer_id": canary, "fence": _fences[canary], "first_token": first})
            assert r.status_code == 200 and [first] + r.json()["tokens"] == hf_greedy(hf_llama, prompt, 9), r.text
            assert dr.undrain(node.http, None, node="decode-t").draining is False
            assert not flag.exists() and c.get("/health").status_code == 200
    finally:
        stop_node(node)
    assert "event=start_drained" in node.log.read_text()


def test_a_drain_keeps_its_reason_across_a_restart(tmp_path: Path) -> None:
    """The reason a drain gave (the router's divergence watch gives one) is in the drain file, so a node that starts
    drained still says why (its /health, /status and `tilepd status`)."""
    from types import SimpleNamespace

    from tilepd.runtime.service import DecodeService, _reason_in

    path = tmp_path / "run" / "decode-d0.drained"
    svc = SimpleNamespace(slot=SimpleNamespace(draining=False), config=SimpleNamespace(drain_file=path, name="d0"), drain_reason=None)
    DecodeService.set_draining(svc, True, "divergence watch: 2 checks in a row diverged")  # type: ignore[arg-type]
    assert svc.slot.draining and svc.drain_reason == "divergence watch: 2 checks in a row diverged"
    assert _reason_in(path) == svc.drain_reason
    DecodeService.set_draining(svc, False)  # type: ignore[arg-type]
    assert not path.exists() and svc.drain_reason is None
    DecodeService.set_draining(svc, True)  # type: ignore[arg-type]
    assert _reason_in(path) is None and path.read_text().startswith("drained at ")
