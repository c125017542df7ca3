"""Claim decision (marker parsing, allowlist, length) and the event-line format tests read."""

from __future__ import annotations

from tilepd.connector.events import EventLog, parse_event_lines
from tilepd.connector.claim import decide_claim
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig

CFG = ConnectorExtraConfig(
    decode_allowlist=(DecodeEndpoint(name="d0", host="10.0.0.5", ctrl_port=5556, http_port=8200),),
    transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=1000,
)
GOOD = {"host": "10.0.0.5", "ctrl_port": 5556, "transfer_id": "tx-1", "token": "ab12"}


def test_requests_without_the_marker_are_not_ours() -> None:
    assert decide_claim(None, 10, CFG) is None
    assert decide_claim({}, 10, CFG) is None
    nixl_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    assert decide_claim(nixl_params, 10, CFG) is None


def test_marked_request_for_an_allowed_node_is_claimed() -> None:
    d = decide_claim({"tilepd": GOOD, "do_remote_decode": False}, 10, CFG)
    assert d is not None and d.marker is not None and d.refused is None
    assert (d.marker.host, d.marker.ctrl_port, d.transfer_id) == ("10.0.0.5", 5556, "tx-1")


def test_refusals_name_the_reason() -> None:
    other_host = decide_claim({"tilepd": {**GOOD, "host": "10.0.0.6"}}, 10, CFG)
    assert other_host.marker is None and "10.0.0.6:5556 is not in the allowlist (10.0.0.5:5556)" in other_host.refused
    other_port = decide_claim({"tilepd": {**GOOD, "ctrl_port": 1}}, 10, CFG)
    assert other_port.marker is None and "allowlist" in other_port.refused
    bad = decide_claim({"tilepd": {**GOOD, "token": ""}}, 10, CFG)
    assert bad.marker is None and "tilepd.token" in bad.refused and bad.transfer_id == "tx-1"
    extra_key = decide_claim({"tilepd": {**GOOD, "evil": 1}}, 10, CFG)
    assert extra_key.marker is None and "tilepd.evil" in extra_key.refused
    not_obj = decide_claim({"tilepd": "10.0.0.5"}, 10, CFG)
    assert not_obj.marker is None and not_obj.transfer_id is None
    too_long = decide_claim({"tilepd": GOOD}, 1001, CFG)
    assert too_long.marker is None and "1001 tokens exceeds max_seq_len 1000" in too_long.refused


def test_event_lines_round_trip(caplog) -> None:
    ev = EventLog("worker")
    ev.count(sent=1, bytes=4096)
    with caplog.at_level("INFO", logger="tilepd.connector"):
        ev.event("failed", "cmpl-1-0", transfer_id="tx-9", message='refused: "x" at y', extract_ms=1.23456)
    (rec,) = parse_event_lines(caplog.text)
    assert rec["role"] == "worker" and rec["event"] == "failed" and rec["req"] == "cmpl-1-0"
    assert rec["message"] == 'refused: "x" at y' and rec["extract_ms"] == "1.235"
    assert rec["counters"]["sent"] == 1 and rec["counters"]["bytes"] == 4096
