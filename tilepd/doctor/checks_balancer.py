"""Checks of the load balancer host (topology `balancer:`, HAProxy): the binary, its configuration, the routers behind it.

As in checks_host, `evaluate_*` are pure (tool text in, findings out) and `run_*` executes on the host through a Probe.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from tilepd.deploy.balancer import BalancerError, backend_states
from tilepd.deploy.remote import Output
from tilepd.doctor.expect import HostExpect
from tilepd.doctor.probe import Probe, first_line, missing_tool
from tilepd.doctor.result import Finding, ok, skip
from tilepd.plan import Plan

_VERSION = re.compile(r"HA-?Proxy version (\d+)\.(\d+)[^\s]*")
MIN_HAPROXY = (2, 0)  # `retry-on`, `http-check expect`, logging to stdout


def evaluate_haproxy(host: str, binary: str, version: Output, config: Output | None, config_file: str) -> list[Finding]:
    """haproxy-binary (present, recent enough) and haproxy-config (the rendered file parses, once `up` placed it)."""
    if missing_tool(version) or version.rc != 0:
        return [Finding("haproxy-binary", host, "warn", f"{binary}: {first_line(version.stderr) or 'not found'}",
                        "`tilepd up` installs Debian's haproxy package there (apt, as root or through sudo); or set balancer.haproxy "
                        "to the binary's path", required=False)]
    m = _VERSION.search(version.stdout + version.stderr)
    if m is None:
        return [Finding("haproxy-binary", host, "warn", f"{binary} -v said {first_line(version.stdout)!r}: no HAProxy version in it",
                        required=False)]
    seen = (int(m[1]), int(m[2]))
    out = [ok("haproxy-binary", host, m[0]) if seen >= MIN_HAPROXY else
           Finding("haproxy-binary", host, "fail", f"{m[0]}: the rendered configuration needs HAProxy >= {'.'.join(map(str, MIN_HAPROXY))}",
                   "install a newer haproxy (Debian 11 and later ship 2.2+)")]
    if config is None:
        out.append(skip("haproxy-config", host, f"{config_file} not placed yet (before `tilepd up`)", required=False))
    elif config.rc == 0:
        out.append(ok("haproxy-config", host, f"{config_file} is valid"))
    else:
        out.append(Finding("haproxy-config", host, "fail", f"{config_file}: {first_line(config.stderr) or first_line(config.stdout)}",
                           "`tilepd render` and compare; report the rendered file if tilepd wrote it"))
    return out


def evaluate_backends(host: str, states: dict[str, str] | None, routers: list[str], why: str = "") -> Finding:
    """balancer-routers: every router of the topology is UP on the running balancer."""
    if states is None:
        return Finding("balancer-routers", host, "warn", f"the balancer's stats did not answer: {why}", required=False)
    not_up = {r: states.get(r, "absent") for r in routers if states.get(r) != "UP"}
    if not not_up:
        return ok("balancer-routers", host, f"all {len(routers)} router(s) UP: {', '.join(routers)}", required=False)
    listed = ", ".join(f"{r} {s}" for r, s in not_up.items())
    return Finding("balancer-routers", host, "warn", f"{len(not_up)} of {len(routers)} router(s) take no request: {listed}",
                   "`tilepd status` (a draining router comes back after its restart; a DOWN one fails its /health)", required=False)


def run_balancer(probe: Probe, exp: HostExpect, plan: Plan, states: dict[str, dict[str, Any]]) -> list[Finding]:
    svc = next((s for s in exp.daemons if s.role == "balancer"), None)
    b = plan.balancer
    if svc is None or b is None:
        return []
    binary, cfg = svc.argv[0], str(svc.config_file)
    version = probe.sh(f"{shlex.quote(binary)} -v")
    placed = probe.sh(f"test -f {shlex.quote(cfg)}").rc == 0
    config = probe.sh(f"{shlex.quote(binary)} -c -f {shlex.quote(cfg)}") if placed and version.rc == 0 else None
    out = evaluate_haproxy(exp.host.name, binary, version, config, cfg)
    if (states.get(svc.name) or {}).get("running") and b.stats_url:
        try:
            seen: dict[str, str] | None = backend_states(b.stats_url, b.backend)
            why = ""
        except BalancerError as exc:
            seen, why = None, str(exc)
        out.append(evaluate_backends(exp.host.name, seen, [r.name for r in b.backends], why))
    return out
