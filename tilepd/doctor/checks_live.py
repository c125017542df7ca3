"""Checks of a deployment that already runs (doctor on demand): service state, health, router signals.

Before the first `up` nothing runs and these checks say so (skip). They only warn: a degraded
running deployment is `tilepd status`'s verdict (exit 7); doctor points at the runbook.
"""

from __future__ import annotations

from typing import Any

from tilepd.deploy import probes
from tilepd.doctor.expect import HostExpect
from tilepd.doctor.result import Finding, ok, skip

ROLE_RUNBOOK = {"decode": "RB-decode-down", "prefill": "RB-prefill-restarted", "native_decode": "RB-native-fallback", "router": "RB-router-429"}
ROUTE_REASONS = frozenset({"header", "model", "default"})  # the router's own routing choices; any other native reason is a fallback


def evaluate_service(host: str, svc_name: str, role: str, state: dict[str, Any] | None, health: tuple[bool, str] | None,
                     figures: dict[str, Any]) -> Finding:
    """service-state: running and healthy, crashed with orphans, or not started (before `up`)."""
    if state is None:
        return skip("service-state", host, f"{svc_name}: not deployed here yet", required=False)
    if state.get("orphans"):
        return Finding("service-state", host, "fail", f"{svc_name}: main process gone, orphans {state['orphans']} still run (and may hold its ports)",
                       "`tilepd up` ends the orphans and starts it again", "RB-orphaned-ports", required=False)
    if not state.get("running"):
        return skip("service-state", host, f"{svc_name}: stopped", required=False)
    healthy, why = health if health is not None else (True, "no health endpoint")
    if not healthy:
        return Finding("service-state", host, "warn", f"{svc_name} (pid {state.get('pid')}) runs but its health check answers {why}",
                       "follow the runbook", ROLE_RUNBOOK.get(role), required=False)
    extra = ""
    if role == "decode" and figures.get("busy"):
        extra = f", busy with transfer {figures.get('transfer_id')} (if it stays busy, see RB-decode-down)"
    return ok("service-state", host, f"{svc_name} (pid {state.get('pid')}) healthy{extra}", required=False)


def evaluate_router_metrics(host: str, metrics_text: str) -> list[Finding]:
    """router-429 and native-fallback: counters of the router's /metrics since it started."""
    samples = probes.parse_metrics(metrics_text)
    rejected = int(probes.metric_sum(samples, "tilepd_router_responses_total", status="429") or 0)
    fallbacks: dict[str, int] = {}
    for name, labels, value in samples:
        if name == "tilepd_router_routes_total" and labels.get("route") == "native" and labels.get("reason") not in ROUTE_REASONS:
            fallbacks[labels.get("reason", "?")] = fallbacks.get(labels.get("reason", "?"), 0) + int(value)
    out = []
    if rejected:
        out.append(Finding("router-429", host, "warn", f"{rejected} request(s) answered 429 (decode pool busy) since the router started",
                           "more decode nodes, a native pool to fall back to, or a longer queue_timeout_s", "RB-router-429", required=False))
    else:
        out.append(ok("router-429", host, "no 429 answered", required=False))
    total = sum(fallbacks.values())
    if total:
        why = ", ".join(f"{r}: {n}" for r, n in sorted(fallbacks.items()))
        out.append(Finding("native-fallback", host, "warn", f"{total} low-latency request(s) served by the native pool instead ({why})",
                           "see why the low-latency pool refused them", "RB-native-fallback", required=False))
    else:
        out.append(ok("native-fallback", host, "no fallback to the native pool", required=False))
    return out


def probe_vllm_auth(host: str, svc_name: str, base_url: str, timeout_s: float = 5.0) -> Finding:
    """vllm-auth: a running prefill or native vLLM refuses a keyless request (else anyone who reaches its port
    bypasses the router's keys and sets their own kv_transfer_params)."""
    import httpx

    try:
        code = httpx.get(f"{base_url}/v1/models", timeout=timeout_s).status_code
    except httpx.HTTPError as e:
        return Finding("vllm-auth", host, "warn", f"{svc_name}: {base_url}/v1/models did not answer: {type(e).__name__}", required=False)
    if code == 401:
        return ok("vllm-auth", host, f"{svc_name}: a keyless request to {base_url}/v1/models answers 401", required=False)
    return Finding("vllm-auth", host, "fail", f"{svc_name}: a keyless request to {base_url}/v1/models answers {code}: its port is open to "
                   "anyone who reaches it", "`tilepd up` with this tilepd restarts it with the deployment's API key", required=False)


def run_live(exp: HostExpect, states: dict[str, dict[str, Any]]) -> list[Finding]:
    import httpx

    out = []
    for svc in exp.daemons:
        state = states.get(svc.name)
        running = bool(state and state.get("running"))
        health = probes.health(svc) if running else None
        figures = probes.live_figures(svc) if running and health and health[0] else {}
        out.append(evaluate_service(exp.host.name, svc.name, svc.role, state, health, figures))
        if svc.role in ("prefill", "native_decode") and running and health and health[0]:
            out.append(probe_vllm_auth(exp.host.name, svc.name, probes.base_url(svc)))
        if svc.role == "router" and running and health and health[0]:
            try:
                text = httpx.get(f"{probes.base_url(svc)}/metrics", timeout=5).text
            except httpx.HTTPError as e:
                out.append(Finding("router-429", exp.host.name, "warn", f"router /metrics did not answer: {type(e).__name__}", required=False))
                continue
            out += evaluate_router_metrics(exp.host.name, text)
    return out
