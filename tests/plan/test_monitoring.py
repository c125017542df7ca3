"""`tilepd render` emits a Prometheus scrape config and a Grafana dashboard whose metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from ruamel.yaml import YAML

from tilepd.plan import build_plan, render_plan
from tilepd.plan.monitoring import JOBS, grafana_dashboard
from tilepd.resources import examples_dir
from tilepd.topology import load_topology

EXAMPLES = sorted(examples_dir().glob("*.yaml"))
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Sample names the router's and a decode node's real registries expose, from a /metrics text scrape."""
    from tilepd.router.leases import NodePool
    from tilepd.router.metrics import RouterMetrics
    from tilepd.runtime.http_api import _register_drain_gauge
    from tilepd.runtime.metrics import DecodeMetrics
    from tilepd.runtime.slot import Slot

    router = RouterMetrics(NodePool.of(()), breaker_failures=3)
    slot = Slot()
    decode = DecodeMetrics(slot, lambda: 0)
    _register_drain_gauge(SimpleNamespace(metrics=decode, slot=slot))  # what the decode node's app adds
    names: set[str] = set()
    for registry in (router.registry, decode.registry):
        text = generate_latest(registry).decode()
        for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, flags=re.M):
            base = name.removesuffix("_total") if kind == "counter" else name
            names.update(base + s for s in SUFFIXES.get(kind, ("",)))
    return names


def panel_metrics(dashboard: dict) -> dict[str, set[str]]:
    out = {}
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            expr = re.sub(r"\{[^}]*\}|\bby \([^)]*\)", "", t["expr"])  # label matchers and groupings name no metric
            out.setdefault(panel["title"], set()).update(re.findall(r"\b(?:tilepd|vllm)_[a-z_]+\b", expr))
    return out


def test_every_panel_metric_is_exported_by_the_code() -> None:
    exported = exported_names()
    assert "tilepd_router_lease_hold_seconds_bucket" in exported and "tilepd_decode_draining" in exported  # the scrape works
    used = panel_metrics(grafana_dashboard(build_plan(load_topology(examples_dir() / "local.yaml"))))
    assert used and all(used.values()), used  # every panel queries something
    missing = {title: names - exported for title, names in used.items() if names - exported}
    assert not missing, missing
    every = set().union(*used.values())
    for capacity in ("tilepd_router_lease_hold_seconds_bucket", "tilepd_router_lease_wait_seconds_bucket",
                     "tilepd_router_queue_depth", "tilepd_router_responses_total", "tilepd_router_routes_total"):
        assert capacity in every, capacity
    texts = json.dumps(grafana_dashboard(build_plan(load_topology(examples_dir() / "local.yaml"))))
    assert 'status=\\"429\\"' in texts and 'route=\\"native\\"' in texts  # 429s and native fallbacks have panels


def test_panels_do_not_overlap() -> None:
    panels = grafana_dashboard(build_plan(load_topology(EXAMPLES[0])))["panels"]
    cells = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    assert len({p["id"] for p in panels}) == len(panels)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_render_writes_a_scrape_target_per_service(example: Path, tmp_path: Path) -> None:
    plan = build_plan(load_topology(example))
    out = tmp_path / "r"
    render_plan(plan, out)
    prom = YAML(typ="safe", pure=True).load((out / "monitoring/prometheus.yml").read_text())
    dash = json.loads((out / "monitoring/grafana-dashboard.json").read_text())
    assert dash["templating"]["list"][1]["query"] == plan.deployment
    got = {(c["labels"]["tilepd_service"], job["job_name"], c["targets"][0])
           for job in prom["scrape_configs"] for c in job["static_configs"]}
    want = set()
    for host in plan.hosts:
        for svc in host.services:
            if svc.kind == "daemon":
                port = svc.ports["http"]
                want.add((svc.name, JOBS[svc.role], f"{host.address}:{port}"))
    assert got == want
    roles = {job["job_name"] for job in prom["scrape_configs"]}
    assert {"tilepd-router", "tilepd-decode"} <= roles
    assert all(job["metrics_path"] == "/metrics" for job in prom["scrape_configs"])
