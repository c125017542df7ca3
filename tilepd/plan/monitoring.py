"""Monitoring files of a render: a Prometheus scrape config, its alert rules and a Grafana dashboard.

`tilepd render` writes them under `monitoring/` (not copied to any host): the operator points
their own Prometheus at `prometheus.yml` (or pastes its `scrape_configs`; `alerts.yml` beside it
holds the rules it loads) and imports the dashboard. Every target comes from the plan (each daemon's health URL gives host:port), so
a topology change re-renders them. Panels use only metrics the router
(tilepd/router/metrics.py) and the decode node (tilepd/runtime/metrics.py, http_api.py) export;
a test checks each panel's metric names against those live registries.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from tilepd.plan.model import Plan

# role -> Prometheus job; vLLM's own /metrics (prefill, native decode) is scraped too, for its queue figures
JOBS: dict[str, str] = {"router": "tilepd-router", "decode": "tilepd-decode", "prefill": "vllm-prefill", "native_decode": "vllm-native-decode",
                        "balancer": "haproxy-balancer"}  # HAProxy's own exporter on its frontend's /metrics (plan/haproxy.py)
SCRAPE_INTERVAL = "5s"
RATE = "[1m]"  # window of every rate(): a few scrapes at SCRAPE_INTERVAL
SEL = '{tilepd_deployment="$deployment"}'


def scrape_targets(plan: Plan) -> dict[str, list[dict[str, Any]]]:
    """job -> static_configs: one target per daemon with an HTTP endpoint, labelled with its deployment, host and service."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for host in plan.hosts:
        for svc in host.services:
            if svc.kind != "daemon" or svc.health is None or svc.role not in JOBS:
                continue
            url = urlsplit(svc.health.url)
            labels = {"tilepd_deployment": plan.deployment, "tilepd_host": host.name, "tilepd_service": svc.name, "tilepd_role": svc.role}
            jobs.setdefault(JOBS[svc.role], []).append({"targets": [url.netloc], "labels": labels})
    return jobs


def prometheus_config(plan: Plan) -> dict[str, Any]:
    """A complete prometheus.yml (global + scrape_configs) for the plan's router, decode nodes and vLLM instances."""
    scheme = {urlsplit(s.health.url).scheme for h in plan.hosts for s in h.services if s.health is not None} or {"http"}
    if len(scheme) != 1:
        raise ValueError(f"services of {plan.deployment} mix URL schemes {sorted(scheme)}; one scrape config per scheme is not rendered")
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "15s"},
        "rule_files": [ALERTS_FILE],
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics", "scheme": next(iter(scheme)), "static_configs": static}
            for job, static in scrape_targets(plan).items()
        ],
    }


ALERTS_FILE = "alerts.yml"  # beside prometheus.yml; Prometheus resolves rule_files relative to its config file
ALERT_WINDOW = "[10m]"


def alert_rules(plan: Plan) -> dict[str, Any]:
    """The alert rules of the plan's deployment: each names the runbook of its failure mode."""
    dep = f'tilepd_deployment="{plan.deployment}"'
    rules = [
        {"alert": "TilepdDecodeNodeDiverges",
         "expr": f'sum by (node) (increase(tilepd_router_divergence_checks_total{{{dep}, verdict="diverged"}}{ALERT_WINDOW})) > 0',
         "labels": {"severity": "critical", "runbook": "RB-divergence"},
         "annotations": {"summary": "decode node {{ $labels.node }} decodes tokens the prefill's model would not choose",
                         "description": "The router's divergence watch scored {{ $value }} check(s) of the node's greedy tokens outside the "
                                        "margin of the prefill's top-1 in 10 minutes (teacher-forced); after `diverged_checks` in a row "
                                        "it drains the node. `tilepd runbook RB-divergence`."}},
        {"alert": "TilepdFingerprintMismatch",
         "expr": f'sum (increase(tilepd_router_routes_total{{{dep}, route="native", reason="fingerprint_mismatch"}}{ALERT_WINDOW})) > 0',
         "labels": {"severity": "warning", "runbook": "RB-fingerprint-mismatch"},
         "annotations": {"summary": "the prefill serves another checkpoint than a decode node's weights",
                         "description": "{{ $value }} low-latency request(s) went to the native pool in 10 minutes because the prefill "
                                        "refused to hand the KV to a node of another checkpoint. `tilepd runbook RB-fingerprint-mismatch`."}},
    ]
    return {"groups": [{"name": f"tilepd-{plan.deployment}", "rules": rules}]}


def _q(expr: str, legend: str) -> dict[str, str]:
    return {"expr": expr, "legendFormat": legend}


def _quantiles(metric: str, by: str = "") -> list[dict[str, str]]:
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [_q(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{SEL}{RATE})))", f"p{int(q * 100)}{suffix}") for q in (0.5, 0.99)]


# (title, unit, queries); a row starts at a title beginning with "# "
PANELS: list[tuple[str, str, list[dict[str, str]]]] = [
    ("# Router", "", []),
    ("Requests by route", "reqps", [_q(f"sum by (route) (rate(tilepd_router_routes_total{SEL}{RATE}))", "{{route}}")]),
    ("Native-pool fallbacks by reason", "reqps",
     [_q(f'sum by (reason) (rate(tilepd_router_routes_total{{tilepd_deployment="$deployment", route="native"}}{RATE}))', "{{reason}}")]),
    ("Responses by HTTP status", "reqps", [_q(f"sum by (status) (rate(tilepd_router_responses_total{SEL}{RATE}))", "{{status}}")]),
    ("429s (capacity refusals)", "reqps",
     [_q(f'sum by (route) (rate(tilepd_router_responses_total{{tilepd_deployment="$deployment", status="429"}}{RATE}))', "{{route}}")]),
    ("Time to first token (low-latency pool)", "s", _quantiles("tilepd_router_ttft_seconds")),
    ("Request time by route", "s", _quantiles("tilepd_router_request_seconds", "route")),
    ("Request time by phase (p99; tilepd trace REQUEST_ID explains one)", "s",
     [_q(f"histogram_quantile(0.99, sum by (le, phase) (rate(tilepd_router_phase_seconds_bucket{SEL}{RATE})))", "{{phase}}")]),
    ("Queue wait for a decode node", "s", _quantiles("tilepd_router_lease_wait_seconds")),
    ("Lease hold (decode node service time)", "s", _quantiles("tilepd_router_lease_hold_seconds")),
    ("Queue depth", "short", [_q(f"sum(tilepd_router_queue_depth{SEL})", "waiting")]),
    ("Decode nodes in rotation / leased", "short",
     [_q(f"sum(tilepd_router_nodes_in_rotation{SEL})", "in rotation"), _q(f"sum(tilepd_router_nodes_leased{SEL})", "leased")]),
    ("Decode-node utilisation (lease hold time per node)", "percentunit",
     [_q(f"sum(rate(tilepd_router_lease_hold_seconds_sum{SEL}{RATE})) / sum(tilepd_router_nodes_in_rotation{SEL})", "busy share")]),
    ("Share of time with k decode nodes leased (tilepd capacity's busy levels)", "percentunit",
     [_q(f"sum by (busy) (rate(tilepd_router_pool_busy_seconds_total{SEL}{RATE}))", "{{busy}} busy")]),
    ("Service time by busy nodes (a shared-host slowdown shows as a rising line)", "s",
     [_q(f"sum by (busy) (rate(tilepd_router_pool_busy_node_seconds_total{SEL}{RATE})) / "
         f"sum by (busy) (rate(tilepd_router_pool_releases_total{SEL}{RATE}))", "{{busy}} busy")]),
    ("Generated tokens (low-latency pool)", "short", [_q(f"sum(rate(tilepd_router_completion_tokens_total{SEL}{RATE}))", "tokens/s")]),
    ("Failovers by cause", "reqps", [_q(f"sum by (cause) (rate(tilepd_router_failovers_total{SEL}{RATE}))", "{{cause}}")]),
    ("Decode-node errors seen by the router", "reqps",
     [_q(f"sum by (node, code) (rate(tilepd_router_decode_errors_total{SEL}{RATE}))", "{{node}} {{code}}")]),
    ("Breaker transitions", "short", [_q(f"sum by (node, state) (increase(tilepd_router_breaker_transitions_total{SEL}{RATE}))", "{{node}} {{state}}")]),
    ("Divergence checks by node and verdict (teacher-forced, RB-divergence)", "short",
     [_q(f"sum by (node, verdict) (increase(tilepd_router_divergence_checks_total{SEL}[5m]))", "{{node}} {{verdict}}")]),
    ("Worst gap below the prefill's top-1 in a node's last check (nats)", "short",
     [_q(f"max by (node) (tilepd_router_divergence_worst_gap_nats{SEL})", "{{node}}")]),
    ("# Decode nodes", "", []),
    ("Busy", "short", [_q(f"tilepd_decode_busy{SEL}", "{{tilepd_service}}")]),
    ("Draining", "short", [_q(f"tilepd_decode_draining{SEL}", "{{tilepd_service}}")]),
    ("Tokens/s of the last decode", "short", [_q(f"tilepd_decode_tokens_per_second{SEL}", "{{tilepd_service}}")]),
    ("Generated tokens", "short", [_q(f"sum by (tilepd_service) (rate(tilepd_decode_tokens_total{SEL}{RATE}))", "{{tilepd_service}}")]),
    ("Requests by outcome", "reqps", [_q(f"sum by (outcome) (rate(tilepd_decode_requests_total{SEL}{RATE}))", "{{outcome}}")]),
    ("KV wait (request arrival to KV complete)", "s", _quantiles("tilepd_decode_kv_wait_seconds")),
    ("KV convert / inject", "s", [*_quantiles("tilepd_decode_convert_seconds"), *_quantiles("tilepd_decode_inject_seconds")]),
    ("Decode time", "s", _quantiles("tilepd_decode_decode_seconds")),
    ("KV transfers", "short", [_q(f"sum by (tilepd_service) (rate(tilepd_decode_transfers_total{SEL}{RATE}))", "{{tilepd_service}}")]),
    ("KV bytes received", "Bps", [_q(f"sum by (tilepd_service) (rate(tilepd_decode_transfer_bytes_total{SEL}{RATE}))", "{{tilepd_service}}")]),
    ("Refused control frames", "short", [_q(f"sum by (tilepd_service) (increase(tilepd_decode_ctrl_bad_frames_total{SEL}{RATE}))", "{{tilepd_service}}")]),
]


def grafana_dashboard(plan: Plan) -> dict[str, Any]:
    """A Grafana dashboard (JSON model, schemaVersion 39) of the router and decode metrics, for a Prometheus datasource."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels: list[dict[str, Any]] = []
    x = y = 0
    for title, unit, queries in PANELS:
        pid = len(panels) + 1
        if title.startswith("# "):
            y += 0 if x == 0 else 8
            x = 0
            panels.append({"id": pid, "type": "row", "title": title[2:], "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            y += 1
            continue
        panels.append({
            "id": pid, "type": "timeseries", "title": title, "datasource": ds,
            "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{**q, "refId": chr(ord("A") + i), "datasource": ds} for i, q in enumerate(queries)],
        })
        x += 8
        if x >= 24:
            x, y = 0, y + 8
    return {
        "title": f"tilepd {plan.deployment}",
        "uid": f"tilepd-{plan.deployment}"[:40],
        "tags": ["tilepd"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "deployment", "type": "constant", "query": plan.deployment, "hide": 2},
        ]},
        "panels": panels,
    }
