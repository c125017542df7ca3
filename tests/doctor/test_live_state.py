"""Checks of a running deployment: service state verdicts, and the router's real metrics read for 429s and fallbacks."""

from __future__ import annotations

from tilepd.doctor.checks_live import evaluate_router_metrics, evaluate_service
from tilepd.router.leases import NodePool
from tilepd.router.metrics import RouterMetrics


def test_router_metrics_as_the_router_renders_them() -> None:
    m = RouterMetrics(NodePool.of(()), breaker_failures=3)
    quiet = {f.check: f.verdict for f in evaluate_router_metrics("r", m.render().decode())}
    assert quiet == {"router-429": "ok", "native-fallback": "ok"}
    m.routes.labels("native", "default").inc(5)  # routed there by policy: not a fallback
    m.routes.labels("native", "header").inc(1)
    m.routes.labels("low_latency", "default").inc(9)
    m.responses.labels("low_latency", "200").inc(9)
    assert {f.verdict for f in evaluate_router_metrics("r", m.render().decode())} == {"ok"}
    m.routes.labels("native", "busy").inc(3)
    m.routes.labels("native", "unsupported:logprobs").inc(1)
    m.responses.labels("low_latency", "429").inc(2)
    found = {f.check: f for f in evaluate_router_metrics("r", m.render().decode())}
    assert found["router-429"].verdict == "warn" and found["router-429"].evidence.startswith("2 request(s) answered 429")
    assert found["router-429"].runbook == "RB-router-429" and not found["router-429"].required
    fb = found["native-fallback"]
    assert fb.verdict == "warn" and "4 low-latency request(s)" in fb.evidence and "busy: 3" in fb.evidence and "unsupported:logprobs: 1" in fb.evidence
    assert fb.runbook == "RB-native-fallback"


def test_service_state_verdicts() -> None:
    assert evaluate_service("h", "decode-d0", "decode", None, None, {}).verdict == "skip"
    assert evaluate_service("h", "decode-d0", "decode", {"running": False, "orphans": []}, None, {}).verdict == "skip"
    orphans = evaluate_service("h", "prefill-p0", "prefill", {"running": False, "orphans": [41, 42]}, None, {})
    assert orphans.verdict == "fail" and "[41, 42]" in orphans.evidence and orphans.runbook == "RB-orphaned-ports"
    sick = evaluate_service("h", "decode-d0", "decode", {"running": True, "pid": 7}, (False, "HTTP 503"), {})
    assert sick.verdict == "warn" and "HTTP 503" in sick.evidence and sick.runbook == "RB-decode-down"
    prefill = evaluate_service("h", "prefill-p0", "prefill", {"running": True, "pid": 8}, (False, "ConnectError"), {})
    assert prefill.runbook == "RB-prefill-restarted"
    busy = evaluate_service("h", "decode-d0", "decode", {"running": True, "pid": 7}, (True, "HTTP 200"), {"busy": True, "transfer_id": "t-1"})
    assert busy.verdict == "ok" and "busy with transfer t-1" in busy.evidence
