"""Live figures and the canary, read over HTTP from the controller.

Each role exposes different endpoints: the decode server `/status` (docs/INTERFACES.md §4),
stock vLLM `/health` + Prometheus `/metrics`, the router `/metrics`. These readers turn
them into a few numbers per service for `tilepd status`, and `canary` sends one real
chat request through the router and checks that a decode node handled it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tilepd.deploy.balancer import BalancerError, backend_states
from tilepd.plan import Plan, Service
from tilepd.runbooks import see
from tilepd.plan.builder import BALANCER_BACKEND
from tilepd.plan.haproxy import STATS_PATH

VERDICT_WAIT_S = 30.0  # how long `up`'s canary waits for the router's check of its request
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEnaIf]+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def base_url(service: Service) -> str | None:
    """scheme://host:port of a service, from its health URL."""
    if service.health is None:
        return None
    u = urlsplit(service.health.url)
    return f"{u.scheme}://{u.netloc}"


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> (name, labels, value) samples."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return out


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **match: str) -> float | None:
    """Sum of a metric's samples whose labels match; None when the metric is absent."""
    vals = [v for n, labels, v in samples if n == name and all(labels.get(k) == want for k, want in match.items())]
    return sum(vals) if vals else None


def _says_draining(r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == "draining"


def health(service: Service, timeout_s: float = 2.0) -> tuple[bool, str]:
    if service.health is None:
        return True, "no health endpoint"
    try:
        r = httpx.get(service.health.url, timeout=timeout_s)
    except httpx.HTTPError as e:
        return False, type(e).__name__
    if r.status_code == 503 and _says_draining(r):
        return False, "draining"  # alive, taking no new request (tilepd drain): not serving, so not healthy
    return r.status_code == 200, f"HTTP {r.status_code}"


def live_figures(service: Service, timeout_s: float = 2.0) -> dict[str, Any]:
    """A few live numbers per role; {} when the endpoint does not answer."""
    url = base_url(service)
    if url is None:
        return {}
    if service.role == "balancer":  # each router's state on the balancer (HAProxy's stats page)
        try:
            return {"backends": backend_states(f"http://{urlsplit(url).hostname}:{service.ports['stats']}{STATS_PATH}", BALANCER_BACKEND,
                                               timeout_s)}
        except (BalancerError, KeyError):
            return {}
    try:
        if service.role == "decode":
            st = httpx.get(f"{url}/status", timeout=timeout_s).json()
            last = st.get("last") or {}
            return {
                "state": st.get("state"),
                "busy": st.get("busy"),
                "transfer_id": st.get("transfer_id"),
                "tokens_per_s": last.get("tokens_per_s"),
                "transfers_total": st.get("transfers_total"),
                "fingerprint": st.get("fingerprint"),
                "drain_reason": st.get("drain_reason"),
            }
        samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=timeout_s).text)
        if service.role in ("prefill", "native_decode"):
            return {
                "running": metric_sum(samples, "vllm:num_requests_running"),
                "waiting": metric_sum(samples, "vllm:num_requests_waiting"),
            }
        if service.role == "router":
            routes = {}
            for n, labels, v in samples:
                if n == "tilepd_router_routes_total":
                    routes[labels.get("route", "?")] = routes.get(labels.get("route", "?"), 0) + v
            return {  # low-latency requests in flight: each holds one decode node
                "in_flight": metric_sum(samples, "tilepd_router_nodes_leased"),
                "queued": metric_sum(samples, "tilepd_router_queue_depth"),
                "routes": {k: int(v) for k, v in sorted(routes.items())},
                "rejected_429": int(metric_sum(samples, "tilepd_router_responses_total", status="429") or 0),
            }
    except (httpx.HTTPError, ValueError):
        return {}
    return {}


@dataclass
class RouterCanaryResult:
    ok: bool
    message: str
    text: str = ""
    completion_tokens: int = 0
    transfers_before: int = 0
    transfers_after: int = 0
    seconds: float = 0.0
    failed_service: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _api_key(plan: Plan) -> str | None:
    router = next((s for h in plan.hosts for s in h.services if s.role == "router"), None)
    cfg = (router.config or {}) if router else {}
    if cfg.get("api_key_env"):
        return os.environ.get(cfg["api_key_env"])
    # a key `up` wrote from the operator's environment: read it there, not from the router host's file
    source = next((s.source_env for h in plan.hosts for s in h.secrets if s.path == cfg.get("api_key_file")), None)
    if source:
        return os.environ.get(source)
    if cfg.get("api_key_file"):
        try:
            return Path(cfg["api_key_file"]).read_text().strip()
        except OSError:
            return None
    return None


def _transfers(decodes: list[Service]) -> int:
    total = 0
    for svc in decodes:
        try:
            total += int(httpx.get(f"{base_url(svc)}/status", timeout=5).json().get("transfers_total") or 0)
        except (httpx.HTTPError, ValueError, TypeError):
            pass
    return total


def canary(plan: Plan, served_model: str, *, timeout_s: float = 120.0, max_tokens: int = 8, attempts: int = 3) -> RouterCanaryResult:
    """One chat request through the router; it must return tokens and move a decode node's transfer counter.

    A cold vLLM can take long over its first request (lazy warm-up), long enough for the
    decode node to give up on the KV; a retryable failure (5xx, timeout) is retried.
    """
    result = _canary_once(plan, served_model, timeout_s=timeout_s, max_tokens=max_tokens)
    for attempt in range(2, attempts + 1):
        if result.ok or not result.extra.get("retryable"):
            break
        time.sleep(1.0)
        result = _canary_once(plan, served_model, timeout_s=timeout_s, max_tokens=max_tokens)
        result.extra["attempt"] = attempt
    return result


def _canary_once(plan: Plan, served_model: str, *, timeout_s: float, max_tokens: int) -> RouterCanaryResult:
    services = [s for h in plan.hosts for s in h.services]
    # through the balancer when tilepd runs one (the operator's endpoint), else the (first) router
    router = next((s for s in services if s.role == "balancer"), None) or next((s for s in services if s.role == "router"), None)
    decodes = [s for s in services if s.role == "decode"]
    if router is None or base_url(router) is None:
        return RouterCanaryResult(False, "no router in the plan", failed_service="router")
    before = _transfers(decodes)
    # the router's divergence watch checks this request (x-tilepd-verify): its verdict is read back below
    headers = {"x-request-id": f"tilepd-canary-{int(time.time())}", "x-tilepd-verify": "1"}
    key = _api_key(plan)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {
        "model": served_model,
        "messages": [{"role": "user", "content": "tilepd canary: say something."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{base_url(router)}/v1/chat/completions", json=body, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        return RouterCanaryResult(False, f"router did not answer the canary: {type(e).__name__}: {e}", failed_service=router.name, extra={"retryable": True})
    seconds = time.monotonic() - t0
    if r.status_code != 200:
        return RouterCanaryResult(
            False, f"router answered HTTP {r.status_code}: {r.text[:500]}", failed_service=router.name, seconds=seconds,
            extra={"retryable": r.status_code >= 500 or r.status_code == 429},
        )  # fmt: skip
    data = r.json()
    text = ((data.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
    tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
    after = _transfers(decodes)
    route = r.headers.get("x-tilepd-route")
    if tokens <= 0:
        return RouterCanaryResult(False, f"canary produced no tokens: {data}", failed_service=router.name, seconds=seconds)
    if decodes and after <= before:
        return RouterCanaryResult(
            False,
            f"canary answered (route {route}) but no decode node's transfers_total moved ({before} -> {after}): the KV handoff did not happen",
            text=text, completion_tokens=tokens, transfers_before=before, transfers_after=after, seconds=seconds,
            failed_service=decodes[0].name,
        )  # fmt: skip
    extra: dict[str, Any] = {"route": route}
    watched = bool(((router.config or {}).get("divergence_watch") or {}).get("enabled", True))
    if route == "low_latency" and watched:
        check = _router_verdict(base_url(router) or "", {k: v for k, v in headers.items() if k == "Authorization"}, headers["x-request-id"])
        extra["verification"] = check
        verdict = (check or {}).get("verdict") or {}
        if check is not None and verdict.get("checked") and not verdict.get("ok"):
            node = str(check.get("node"))
            return RouterCanaryResult(
                False, f"decode node {node}'s tokens diverge from the prefill's model: {verdict.get('summary')}" + see("RB-divergence"),
                text=text, completion_tokens=tokens, transfers_before=before, transfers_after=after, seconds=seconds,
                failed_service=next((d.name for d in decodes if (d.config or {}).get("name") == node), None), extra=extra,
            )  # fmt: skip
    return RouterCanaryResult(True, "ok", text=text, completion_tokens=tokens, transfers_before=before, transfers_after=after, seconds=seconds, extra=extra)


def _router_verdict(router_url: str, headers: dict[str, str], request_id: str, wait_s: float = VERDICT_WAIT_S) -> dict[str, Any] | None:
    """The router's teacher-forced check of one request (its /status `divergence.recent`), None when it gave none in time."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            recent = httpx.get(f"{router_url}/status", headers=headers, timeout=5).json().get("divergence", {}).get("recent", [])
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        found = next((c for c in recent if c.get("request_id") == request_id), None)
        if found is not None:
            return found
        time.sleep(0.5)
    return None
