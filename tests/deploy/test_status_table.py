"""`tilepd status` at 80 columns: one line per service, names whole, for every bundled example."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from tilepd.deploy.status import ServiceStatus, table
from tilepd.plan import build_plan
from tilepd.resources import examples_dir
from tilepd.topology import load_topology

EXAMPLES = sorted(examples_dir().glob("*.yaml"))

# the widest figures and states a service can show (large counters, every run state)
FIGURES = {
    "decode": {"state": "decoding", "busy": True, "transfer_id": "t" * 40, "tokens_per_s": 12345.6, "transfers_total": 9_999_999},
    "prefill": {"running": 1024, "waiting": 99999},
    "native_decode": {"running": 1024, "waiting": 99999},
    "router": {"in_flight": 9999, "queued": 99999, "routes": {"tilepd": 10**9, "native": 10**9}, "rejected_429": 10**7},
}
RUNS = ["running", "running", "stopped", "crashed (orphans)", "not deployed", "unreachable", "unknown"]


def rows_for(example: Path, all_running: bool = False) -> list[ServiceStatus]:
    plan = build_plan(load_topology(example))
    rows = []
    daemons = [(host, svc) for host in plan.hosts for svc in host.services if svc.kind == "daemon"]
    for i, (host, svc) in enumerate(daemons):
        if True:
            run = "running" if all_running else RUNS[i % len(RUNS)]
            healthy = run == "running"
            rows.append(ServiceStatus(
                host=host.name, service=svc.name, role=svc.role, run=run, pid=4_194_304,
                healthy=healthy, health="HTTP 200" if healthy else "ConnectError",
                figures=FIGURES.get(svc.role, {}) if healthy else {},
                drift=["config 0123456789ab != topology ba9876543210", "tilepd 0.0.1 != controller 9.9.9"] if i % len(RUNS) == 1 else [],
            ))
    return rows


def render(rows: list[ServiceStatus], wide: bool = False, width: int = 80) -> list[str]:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(table(rows, wide=wide))
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("all_running", [False, True], ids=["mixed", "all-running"])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_one_line_per_service_within_80_columns(example: Path, all_running: bool) -> None:
    rows = rows_for(example, all_running)
    lines = render(rows)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    for r in rows:
        hits = [line for line in lines if f" {r.service} " in f" {line} " and line.startswith(r.host)]
        assert len(hits) == 1, (r.service, lines)  # whole name, host first, exactly one line
        assert "…" not in hits[0].split(r.service)[0]  # host and service uncut
    # title, header and one line per service: nothing wrapped onto a second line
    assert len([line for line in lines if line.strip()]) == len(rows) + 2, "\n".join(lines)


def test_short_columns_say_state_health_and_a_figure() -> None:
    rows = rows_for(examples_dir() / "local.yaml")
    running = next(r for r in rows if r.run == "running" and not r.drift)
    line = next(line for line in render(rows) if running.service in line)
    assert "running" in line and " ok " in f"{line} "
    drifted = next(r for r in rows if r.drift)
    assert " drift " in next(line for line in render(rows) if drifted.service in line)
    assert any(word in line for word in ("tok/s", "wait", "429")), line
    crashed = next((r for r in rows if r.run.startswith("crashed")), None)
    if crashed is not None:
        assert "crashed" in next(line for line in render(rows) if crashed.service in line)


def test_a_drained_node_says_draining() -> None:
    rows = rows_for(examples_dir() / "local.yaml", all_running=True)
    node = next(r for r in rows if r.role == "decode")
    node.healthy, node.health, node.figures, node.drift = False, "draining", {}, []
    line = next(line for line in render(rows) if node.service in line)
    assert line.split()[2:4] == ["running", "draining"], line


def test_wide_keeps_every_detail() -> None:
    rows = rows_for(examples_dir() / "lab-3host.yaml")
    text = "".join(render(rows, wide=True, width=250)).replace(" ", "")
    for r in rows:
        for d in r.drift:
            assert d.replace(" ", "") in text
    assert "4194304" in text  # the pid
    assert "ConnectError" in text and "transfer" + "t" * 40 in text  # the full health reason and live figures


def test_cli_status_of_the_default_at_80_columns(tmp_path: Path) -> None:
    """`tilepd status` on the embedded default, never deployed for this user: one short line per service, exit 7."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "HOME": str(tmp_path)}  # a fresh user: nothing deployed under ~/.local/state
    r = subprocess.run([sys.executable, "-m", "tilepd.cli.app", "status"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 7, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), r.stdout
    rows = [line for line in lines if line.startswith("127.0.0.1 ")]
    assert sorted(line.split()[1] for line in rows) == ["decode-d0", "prefill-p0", "router"], r.stdout
    assert all("not deployed" in line for line in rows) and "degraded" in r.stdout
