"""The load balancer in front of the routers (issue 28 part 3): HAProxy's service and configuration, or an external
balancer's backend list."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tilepd.deploy.inventory import host_vars, service_spec
from tilepd.plan import build_plan, render_plan
from tilepd.resources import examples_dir
from tilepd.topology import load_topology


def _ha(tmp_path: Path, external: bool = False) -> Path:
    text = (examples_dir() / "local-ha.yaml").read_text().replace("~/.local/state/tilepd/local-ha", str(tmp_path / "base"))
    if external:
        text = text.replace("  stats_port: 18904\n", "  external: true\n")
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return path


def test_haproxy_runs_after_the_routers_in_front_of_every_one_of_them(tmp_path: Path) -> None:
    plan = build_plan(load_topology(_ha(tmp_path)))
    (host,) = plan.hosts
    assert [s.name for s in host.services if s.kind == "daemon"] == ["decode-d0", "decode-d1", "prefill-p0", "router-r0", "router-r1", "balancer"]
    assert host.roles == ["prefill", "decode", "router", "balancer"]
    lb = plan.service("balancer")
    assert lb.argv == ["/usr/sbin/haproxy", "-db", "-f", f"{tmp_path}/base/config/balancer.cfg"] and lb.stage == 5
    assert lb.health is not None and lb.health.url == "http://127.0.0.1:18900/balancer/health" and lb.ports == {"http": 18900, "stats": 18904}
    cfg = lb.config["text"]
    assert "balance leastconn" in cfg and "option httpchk GET /health" in cfg and "retry-on conn-failure" in cfg
    assert "server r0 127.0.0.1:18901 check" in cfg and "server r1 127.0.0.1:18902 check" in cfg
    assert "bind 127.0.0.1:18900" in cfg and "bind 127.0.0.1:18904" in cfg and "timeout server 610s" in cfg
    b = plan.balancer
    assert b is not None and not b.external and b.stats_url == "http://127.0.0.1:18904/stats" and [x.service for x in b.backends] == [
        "router-r0", "router-r1"]


@pytest.mark.skipif(shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists(),
                    reason="haproxy is not installed (scripts/bootstrap.sh installs Debian's package)")
def test_the_rendered_configuration_is_valid_haproxy(tmp_path: Path) -> None:
    plan = build_plan(load_topology(_ha(tmp_path)))
    render_plan(plan, tmp_path / "out")
    cfg = tmp_path / "out" / "hosts" / "127.0.0.1" / "config" / "balancer.cfg"
    assert cfg.read_text() == plan.service("balancer").config["text"]
    check = subprocess.run([shutil.which("haproxy") or "/usr/sbin/haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_router_restart_knows_where_the_balancer_shows_it(tmp_path: Path) -> None:
    topo = load_topology(_ha(tmp_path))
    plan = build_plan(topo)
    spec = service_spec(plan, plan.service("router-r1"))
    assert spec.balancer is not None and spec.balancer.server == "r1" and spec.balancer.backend == "routers"
    assert spec.balancer.stats_url == "http://127.0.0.1:18904/stats" and spec.balancer.drain_timeout_s == 120.0
    assert service_spec(plan, plan.service("decode-d0")).balancer is None
    assert host_vars(plan, topo, plan.hosts[0], tmp_path / "out")["tilepd_haproxy"] == "/usr/sbin/haproxy"


def test_an_external_balancer_gets_its_backend_list_and_no_service(tmp_path: Path) -> None:
    plan = build_plan(load_topology(_ha(tmp_path, external=True)))
    assert "balancer" not in {s.role for h in plan.hosts for s in h.services}
    written = render_plan(plan, tmp_path / "out")
    backends = json.loads((tmp_path / "out" / "balancer" / "backends.json").read_text())
    assert [(r["name"], r["port"], r["health_url"]) for r in backends["backends"]] == [
        ("r0", 18901, "http://127.0.0.1:18901/health"), ("r1", 18902, "http://127.0.0.1:18902/health")]
    assert backends["deployment_endpoint"] == "127.0.0.1:18900" and backends["health_check"]["expect_status"] == 200
    assert tmp_path / "out" / "balancer" / "haproxy.cfg" in written
    spec = service_spec(plan, plan.service("router-r0"))
    assert spec.balancer is not None and spec.balancer.stats_url is None  # a restart waits its checks' pace instead


@pytest.mark.skipif(shutil.which("systemd-analyze") is None or not Path("/usr/sbin/haproxy").exists(),
                    reason="systemd-analyze (Debian package systemd) or haproxy not installed")
def test_the_balancers_systemd_unit_passes_verify_runs_as_the_service_user_and_is_sandboxed(tmp_path: Path) -> None:
    path = _ha(tmp_path)
    path.write_text(path.read_text().replace("services: process", "services: systemd"))
    plan = build_plan(load_topology(path))
    render_plan(plan, tmp_path / "out")
    unit = tmp_path / "out" / "hosts" / "127.0.0.1" / "units" / "tilepd-balancer.service"
    text = unit.read_text()
    assert f"ExecStart=/usr/sbin/haproxy -db -f {tmp_path}/base/config/balancer.cfg" in text and "Type=simple" in text
    assert "Restart=on-failure" in text and "PrivateDevices=yes" in text and "\nCapabilityBoundingSet=\n" in text
    assert "\nUser=tilepd\nGroup=tilepd\n" in text, text  # the service user, as every unit (HAProxy switches to no user itself)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
