"""Doctor on the balancer host: HAProxy's binary and configuration, and the routers it can send requests to."""

from __future__ import annotations

from tilepd.deploy.remote import Output
from tilepd.doctor.checks_balancer import evaluate_backends, evaluate_haproxy

VERSION = "HAProxy version 2.6.12-1+deb12u4 2026/10/17 - https://haproxy.org/\nStatus: long-term supported branch\n"  # Debian 12's
CFG = "/srv/t/config/balancer.cfg"


def _verdicts(findings) -> dict[str, str]:  # noqa: ANN001
    return {f.check: f.verdict for f in findings}


def test_haproxy_present_recent_and_its_config_parses() -> None:
    found = evaluate_haproxy("h", "/usr/sbin/haproxy", Output(0, VERSION, ""), Output(0, "Configuration file is valid\n", ""), CFG)
    assert _verdicts(found) == {"haproxy-binary": "ok", "haproxy-config": "ok"}
    assert found[0].evidence.startswith("HAProxy version 2.6.12")


def test_missing_haproxy_is_what_up_installs_and_an_old_or_broken_one_fails() -> None:
    (missing,) = evaluate_haproxy("h", "/usr/sbin/haproxy", Output(127, "", "sh: 1: /usr/sbin/haproxy: not found"), None, CFG)
    assert missing.verdict == "warn" and "installs Debian's haproxy package" in missing.fix and not missing.required
    old = evaluate_haproxy("h", "/usr/sbin/haproxy", Output(0, "HA-Proxy version 1.8.19 2019/02/11\n", ""), None, CFG)
    assert _verdicts(old) == {"haproxy-binary": "fail", "haproxy-config": "skip"}
    bad = evaluate_haproxy("h", "/usr/sbin/haproxy", Output(0, VERSION, ""),
                           Output(1, "", "[ALERT] config : parsing [/srv/t/config/balancer.cfg:3] : unknown keyword 'x'\n"), CFG)
    assert _verdicts(bad)["haproxy-config"] == "fail" and "unknown keyword" in bad[1].evidence


def test_every_router_up_or_the_ones_that_take_nothing_named() -> None:
    assert evaluate_backends("h", {"r0": "UP", "r1": "UP"}, ["r0", "r1"]).verdict == "ok"
    some = evaluate_backends("h", {"r0": "UP", "r1": "DOWN 1/2"}, ["r0", "r1", "r2"])
    assert some.verdict == "warn" and "2 of 3 router(s) take no request: r1 DOWN 1/2, r2 absent" in some.evidence
    assert evaluate_backends("h", None, ["r0"], "connection refused").verdict == "warn"
