"""Errors name their runbook (issue 14 part 2): every id the code names is a runbook `tilepd runbook` prints,
every runbook is named by an error site outside doctor, and real errors of each failure mode carry their id
(message suffix, log field `runbook=`, or the HTTP error object's `runbook` field)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tilepd.doctor.runbooks import RUNBOOK_ID, all_runbooks, get
from tilepd.runbooks import RUNBOOKS, UnknownRunbook, cite, see, tag

PKG = Path(__file__).resolve().parents[1] / "tilepd"
REGISTRY = {PKG / "runbooks.py", PKG / "doctor" / "runbooks.py"}


def _ids_by_file() -> dict[Path, set[str]]:
    return {p: set(RUNBOOK_ID.findall(p.read_text())) for p in sorted(PKG.rglob("*.py"))}


def test_registry_matches_the_runbook_files() -> None:
    assert {rb.id: rb.title for rb in all_runbooks()} == RUNBOOKS


def test_every_id_in_the_code_is_a_runbook_tilepd_runbook_prints() -> None:
    files = {rb.id for rb in all_runbooks()}
    for path, ids in _ids_by_file().items():
        for rid in ids:
            assert rid in files, f"{path.relative_to(PKG.parent)} names {rid}: no docs/runbooks/{rid}.md"
            assert get(rid).path.name == f"{rid}.md"  # what `tilepd runbook ID` resolves


def test_every_runbook_is_named_by_an_error_site_outside_doctor() -> None:
    sites: dict[str, list[str]] = {}
    for path, ids in _ids_by_file().items():
        if path in REGISTRY or path.is_relative_to(PKG / "doctor"):
            continue
        for rid in ids:
            sites.setdefault(rid, []).append(str(path.relative_to(PKG.parent)))
    missing = sorted(set(RUNBOOKS) - set(sites))
    assert not missing, f"no error site outside tilepd/doctor names {missing}"


def test_helpers_format_and_refuse_unknown_ids() -> None:
    assert see("RB-kv-timeout") == " (runbook RB-kv-timeout: tilepd runbook RB-kv-timeout)"
    assert tag("RB-upgrade") == "runbook=RB-upgrade"
    once = cite("boom", "RB-upgrade")
    assert once == "boom" + see("RB-upgrade") and cite(once, "RB-upgrade") == once
    with pytest.raises(UnknownRunbook, match="RB-nope"):
        see("RB-nope")


# -- real errors carry their id ------------------------------------------------------------------------

def test_router_errors_carry_the_runbook_field() -> None:
    from tilepd.router.backends import DecodeNodeError
    from tilepd.router.errors import RouterError, invalid

    busy = RouterError(429, "no decode node free within 5 s; retry later", type="rate_limit_error", code="decode_pool_busy")
    assert busy.body()["error"]["runbook"] == "RB-router-429"
    assert json.loads(json.dumps(busy.body()))["error"]["code"] == "decode_pool_busy"
    assert RouterError(503, "x", code="no_decode_node").body()["error"]["runbook"] == "RB-decode-down"
    assert RouterError(502, "x", code="native_decode_unreachable").body()["error"]["runbook"] == "RB-native-fallback"
    assert "runbook" not in invalid("temperature", "must be >= 0").body()["error"]  # a client's own mistake: no runbook
    # a decode node's kv_timeout relayed by the router, and the same cause inside node_faults
    node_msg = "KV for transfer t1 did not arrive within 1 s (state was reserved); slot freed" + see("RB-kv-timeout")
    assert DecodeNodeError("d0", 504, "kv_timeout", node_msg).to_router_error().body()["error"]["runbook"] == "RB-kv-timeout"
    faults = DecodeNodeError("d0", 502, "node_faults", f"2 decode nodes failed this request; last: kv_timeout: {node_msg}")
    assert faults.to_router_error().runbook == "RB-kv-timeout"
    gone = DecodeNodeError("d0", 502, "transfer_failed", "closed mid-transfer" + see("RB-prefill-restarted"))
    assert gone.to_router_error().runbook == "RB-prefill-restarted"


def test_slot_kv_timeout_and_prefill_gone_name_their_runbooks(caplog: pytest.LogCaptureFixture) -> None:
    from tests.reserved import reserve_and_attach
    from tilepd.runtime.slot import Slot, SlotError

    caplog.set_level(logging.INFO, logger="tilepd.runtime.slot")
    slot = Slot()
    transfer = reserve_and_attach(slot, "t1", "tok")
    with pytest.raises(SlotError) as exc:
        slot.wait_complete(transfer, 0.01)
    assert exc.value.code == "kv_timeout" and exc.value.message.endswith(see("RB-kv-timeout"))
    assert any("code=kv_timeout runbook=RB-kv-timeout" in m for m in caplog.messages), caplog.messages

    transfer = reserve_and_attach(slot, "t2", "tok")
    slot.admit("t2", "tok", seq_len=4, num_blocks=1, expected_bytes=64, layout=None, conn_id=7)
    slot.sender_gone(7)  # the prefill's control connection closed mid-transfer
    with pytest.raises(SlotError) as exc:
        slot.wait_complete(transfer, 1.0)
    assert exc.value.code == "transfer_failed" and "RB-prefill-restarted" in exc.value.message
    assert any("event=transfer_failed" in m and "runbook=RB-prefill-restarted" in m for m in caplog.messages)


def test_protocol_mismatches_name_their_runbook() -> None:
    from tilepd.control.compat import check_protocol
    from tilepd.control.messages import ErrorCode, PROTOCOL_VERSION, ProtocolError
    from tilepd.runtime.ctrl_server import _refusal

    with pytest.raises(ProtocolError) as exc:
        check_protocol(PROTOCOL_VERSION + 1, local_side="decode node", remote_side="prefill connector", remote_version="9.9")
    assert exc.value.message.endswith(see("RB-protocol-mismatch"))
    # a geometry mismatch raised outside compat (runtime/geometry) gets the id where the decode node refuses the hello
    message, field = _refusal(ProtocolError(ErrorCode.LAYOUT_MISMATCH, "the prefill sends 4 KV heads, this node has 2"))
    assert message.endswith(see("RB-protocol-mismatch")) and field == " runbook=RB-protocol-mismatch"
    assert _refusal(ProtocolError(ErrorCode.NOT_ALLOWED, "sender not allowed")) == ("sender not allowed", "")


def test_missing_api_key_names_the_rotation_runbook() -> None:
    from tilepd.deploy.secrets import SecretsError, values_for
    from tilepd.plan import build_plan
    from tilepd.resources import examples_dir
    from tilepd.topology import load_topology

    plan = build_plan(load_topology(examples_dir() / "glm51-seed.yaml"))
    with pytest.raises(SecretsError) as exc:
        values_for(plan, environ={})
    assert "TILEPD_API_KEY" in str(exc.value) and str(exc.value).endswith(see("RB-api-key-rotation"))


def test_unreachable_host_names_its_runbook() -> None:
    from tilepd.deploy.remote import HostUnreachable
    from tilepd.deploy.runner import PlaybookResult, _Digest

    result = PlaybookResult("up.yml", "failed", 4)
    _Digest(result, None)({"event": "runner_on_unreachable", "event_data": {
        "host": "10.0.0.9", "task": "Gathering Facts", "res": {"msg": "Failed to connect to the host via ssh: Connection refused"}}})
    (failure,) = result.unreachable
    assert "Connection refused" in failure.message and failure.message.endswith(see("RB-host-unreachable"))
    assert str(HostUnreachable("10.0.0.9", "timed out")).endswith(see("RB-host-unreachable"))


def test_status_names_runbooks_for_orphans_drift_unreachable_and_down_nodes() -> None:
    from tilepd.deploy.status import ServiceStatus, as_json, runbook_hint

    rows = [
        ServiceStatus("h1", "decode-0", "decode", "crashed (orphans)"),
        ServiceStatus("h1", "router", "router", "running", healthy=True, drift=["tilepd 0.1.0 != controller 0.2.0"]),
        ServiceStatus("h2", "prefill-0", "prefill", "unreachable"),
        ServiceStatus("h3", "decode-1", "decode", "running", healthy=False, health="HTTP 503"),
        ServiceStatus("h3", "prefill-1", "prefill", "stopped"),
        ServiceStatus("h3", "decode-2", "decode", "running", healthy=True, health="HTTP 200"),
        ServiceStatus("h3", "decode-3", "decode", "running", healthy=False, health="draining"),  # `tilepd drain`: on purpose
    ]
    assert [r.runbook for r in rows] == ["RB-orphaned-ports", "RB-upgrade", "RB-host-unreachable", "RB-decode-down",
                                         "RB-prefill-restarted", None, None]
    assert [j["runbook"] for j in as_json(rows)][:2] == ["RB-orphaned-ports", "RB-upgrade"]
    hint = runbook_hint(rows)
    assert "RB-orphaned-ports (decode-0)" in hint and "RB-upgrade (router)" in hint and "tilepd runbook ID" in hint
    assert runbook_hint(rows[-2:]) == ""


def test_bad_weights_manifest_names_its_runbook(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from tilepd.weights.errors import WeightsError
    from tilepd.engine.weights_loader import load_weights

    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(WeightsError) as exc:
        load_weights(tmp_path, torch.device("cpu"), torch.float32)
    assert "not a tilepd weights manifest" in str(exc.value) and str(exc.value).endswith(see("RB-weights-manifest"))


def test_router_http_answer_carries_the_runbook_field(tiny_llama: Path) -> None:
    """The real router app, no decode node and no native pool: the 503 body names RB-decode-down."""
    from fastapi.testclient import TestClient

    from tilepd.contracts.service_configs import RouterConfig, RoutingConfig
    from tilepd.router.app import create_app
    from tilepd.router.auth import ApiKeys

    config = RouterConfig(port=1, served_model_name="m", tokenizer_dir=tiny_llama, prefill_urls=("http://127.0.0.1:9",),
                          decode_nodes=(), routing=RoutingConfig(fallback_to_native=False))
    with TestClient(create_app(config, ApiKeys.load(None, None))) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_decode_node" and r.json()["error"]["runbook"] == "RB-decode-down"


def test_health_gate_failing_on_a_taken_port_names_the_orphans_runbook() -> None:
    from tilepd.deploy.runner import PlaybookResult, _Digest

    def gate(log_tail: list[str]) -> str:
        result = PlaybookResult("up.yml", "failed", 2)
        line = json.dumps({"msg": "decode-0 did not become healthy within 60 s", "name": "decode-0", "log_tail": log_tail})
        _Digest(result, None)({"event": "runner_on_failed", "event_data": {"host": "h1", "task": "health gate: decode", "res": {
            "failed": True, "stdout": line, "msg": "non-zero return code"}}})
        (failure,) = result.failures
        assert failure.health and failure.service == "decode-0"
        return failure.message

    taken = "ERROR: [Errno 98] error while attempting to bind on address ('0.0.0.0', 8200): address already in use"
    assert gate(["INFO: Started server process", taken]).endswith(see("RB-orphaned-ports"))
    assert "runbook" not in gate(["RuntimeError: CUDA out of memory"])
