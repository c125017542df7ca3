"""Supervisor restart rules for rolling restarts: --force, a tilepd upgrade, and a decode node that cannot drain.

Real detached processes (the small HTTP server of test_proc.py, which has /health but no admin API). The
drain itself against real decode nodes under load is tests/router/test_drain_rolling.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.deploy.test_proc import _spec, cleanup  # noqa: F401 - the fixture is used by name
from tilepd.deploy import proc


def test_force_restarts_an_unchanged_service_and_an_upgrade_restarts_it_too(tmp_path: Path, cleanup) -> None:  # noqa: F811
    spec = _spec(tmp_path).model_copy(update={"role": "router"})
    cleanup.append(spec)
    assert proc.start(spec)["action"] == "start" and proc.wait_healthy(spec)["healthy"]
    pid = proc.status(spec)["pid"]
    assert proc.start(spec)["action"] == "none" and proc.status(spec)["pid"] == pid
    forced = proc.start(spec, force=True)
    assert forced["action"] == "restart" and forced["pid"] != pid and "drain" not in forced  # only decode nodes drain
    assert proc.wait_healthy(spec)["healthy"]
    # a state written by another tilepd: the running process is that version's code, so `up` restarts it
    state = json.loads(spec.state_file.read_text())
    spec.state_file.write_text(json.dumps({**state, "tilepd_version": "0.0.1"}))
    assert proc.start(spec, check=True)["action"] == "restart"
    upgraded = proc.start(spec)
    assert upgraded["action"] == "restart" and upgraded["tilepd_version"] != "0.0.1"


def test_a_decode_node_without_the_admin_api_restarts_anyway_and_is_health_gated(tmp_path: Path, cleanup) -> None:  # noqa: F811
    spec = _spec(tmp_path)  # role decode; the server answers GET /health only
    cleanup.append(spec)
    assert proc.start(spec)["action"] == "start" and proc.wait_healthy(spec)["healthy"]
    pid = proc.status(spec)["pid"]
    out = proc.start(spec.model_copy(update={"config_hash": "h2"}))
    assert out["action"] == "restart" and out["pid"] != pid and out["healthy"] is True, out
    assert out["drain"]["drained"] is False and str(spec.health_url).removesuffix("/health") in out["drain"]["error"]
    log = Path(spec.log_file).read_text()
    assert "could not drain before the restart" in log and "restarted after a drain; healthy" in log


def test_cli_force_flag(tmp_path: Path, cleanup, capsys) -> None:  # noqa: F811
    spec = _spec(tmp_path).model_copy(update={"role": "router"})
    cleanup.append(spec)
    path = tmp_path / "svc.spec.json"
    path.write_text(spec.model_dump_json())
    assert proc.main(["start", "--spec", str(path)]) == 0
    pid = json.loads(capsys.readouterr().out)["pid"]
    assert proc.main(["start", "--spec", str(path), "--check", "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["action"] == "restart" and proc.status(spec)["pid"] == pid
    assert proc.main(["start", "--spec", str(path), "--force"]) == 0
    assert json.loads(capsys.readouterr().out)["pid"] != pid
