"""`tilepd up/status/logs/down` for real on this machine: ansible-runner with a local
connection, the real router process, the real supervisor.

This module deploys only the router role (`--only router`), which needs no engine and
no vLLM, so it exercises every deploy mechanism in a few ansible runs; the whole
stack with its canary is in test_stack_local.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import topo
from tests.deploy.cli import Run, processes_mentioning, tilepd
from tests.deploy.leaks import leaks
from tests.waiting import wait_until
from tilepd.auth import node_api_key

pytestmark = pytest.mark.slow


class Deployed:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        data = topo.local_topology(root, name="t-router")
        self.file = topo.write(data, root / "topology.yaml")
        data["router"]["queue_timeout_s"] = 7.5  # a config change: the router's hash moves
        self.changed_file = topo.write(data, root / "topology-changed.yaml")
        self.base = data["deployment"]["base_dir"]

    def run(self, *args: str) -> Run:
        return tilepd(self.home, *args)

    def router_status(self, file: Path | None = None) -> dict:
        r = self.run("status", str(file or self.file), "--json")
        return next(s for s in r.json()["services"] if s["role"] == "router")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    d = Deployed(tmp_path_factory.mktemp("deploy-local"))
    first = d.run("up", str(d.file), "--only", "router")
    try:
        assert first.rc == 0, first
        yield d
    finally:
        d.run("down", str(d.changed_file))
        d.run("down", str(d.file))
        assert processes_mentioning(d.base) == []


def test_first_up_started_the_router(deployed: Deployed) -> None:
    st = deployed.router_status()
    assert st["run"] == "running" and st["healthy"] and st["pid"]
    assert st["figures"]["queued"] == 0 and "routes" in st["figures"]


def test_second_up_reports_zero_changed(deployed: Deployed) -> None:
    pid = deployed.router_status()["pid"]
    again = deployed.run("up", str(deployed.file), "--only", "router")
    assert again.rc == 0, again
    assert again.changed() == 0, again
    assert deployed.router_status()["pid"] == pid


def test_check_mode_reports_a_change_and_changes_nothing(deployed: Deployed) -> None:
    pid = deployed.router_status()["pid"]
    spec = Path(deployed.base) / "run" / "router.spec.json"
    before = spec.read_text()
    check = deployed.run("up", str(deployed.changed_file), "--only", "router", "--check")
    assert check.rc == 0, check
    assert check.changed() >= 2, check  # the files and the restart it would do
    assert "check mode" in check.stdout
    assert spec.read_text() == before
    assert deployed.router_status()["pid"] == pid


def test_status_flags_drift_and_degraded_services(deployed: Deployed) -> None:
    r = deployed.run("status", str(deployed.changed_file), "--json")
    assert r.rc == 7, r  # prefill and decode were never deployed here, and the router drifted
    rows = {s["role"]: s for s in r.json()["services"]}
    # on one host their specs were written with the router's, but nothing started them
    assert rows["decode"]["run"] == "stopped" and rows["prefill"]["run"] == "stopped"
    assert rows["router"]["run"] == "running" and any(d.startswith("config ") for d in rows["router"]["drift"])
    table = deployed.run("status", str(deployed.changed_file))
    assert "degraded" in table.stdout and "stopped" in table.stdout


def test_status_flags_a_host_running_another_tilepd_version(deployed: Deployed) -> None:
    import json

    state_file = Path(deployed.base) / "run" / "router.state.json"
    original = state_file.read_text()
    state = json.loads(original)
    state["tilepd_version"] = "0.0.1"  # what an older controller would have left running
    state_file.write_text(json.dumps(state))
    try:
        st = deployed.router_status()
        assert any("tilepd 0.0.1 != controller" in d for d in st["drift"]), st
    finally:
        state_file.write_text(original)
    assert deployed.router_status()["drift"] == []


def test_changed_config_restarts_only_then_settles(deployed: Deployed) -> None:
    pid = deployed.router_status()["pid"]
    up = deployed.run("up", str(deployed.changed_file), "--only", "router")
    assert up.rc == 0 and up.changed() >= 2, up
    st = deployed.router_status(deployed.changed_file)
    assert st["pid"] != pid and st["drift"] == [] and st["healthy"]
    assert deployed.run("up", str(deployed.changed_file), "--only", "router").changed() == 0


def test_logs_are_prefixed_with_host_and_service(deployed: Deployed) -> None:
    r = deployed.run("logs", str(deployed.file), "--role", "router", "-n", "5")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    assert lines and all(line.startswith("127.0.0.1/router | ") for line in lines)
    assert deployed.run("logs", str(deployed.file), "--host", "10.9.9.9").rc == 2


def test_limit_and_only_are_checked(deployed: Deployed) -> None:
    assert deployed.run("up", str(deployed.file), "--only", "nothing").rc == 2
    bad = deployed.run("up", str(deployed.file), "--limit", "nohost")
    assert bad.rc == 2 and "no such host" in bad.out


def test_health_gate_failure_exits_7_with_the_log(tmp_path: Path) -> None:
    """The router's port is taken: it dies at startup, `up` names it and shows its last lines."""
    data = topo.local_topology(tmp_path, name="t-unhealthy")
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    data["router"]["port"] = blocker.getsockname()[1]
    file = topo.write(data, tmp_path / "topology.yaml")
    try:
        r = tilepd(tmp_path / "home", "up", str(file), "--only", "router")
        assert r.rc == 7, r
        assert "health gate failed" in r.stderr and "router" in r.stderr
        assert "last log lines of router" in r.stderr
    finally:
        blocker.close()
        tilepd(tmp_path / "home", "down", str(file))
    assert processes_mentioning(data["deployment"]["base_dir"]) == []


def test_bad_topology_exits_3(tmp_path: Path) -> None:
    data = topo.local_topology(tmp_path)
    data["router"]["port"] = data["prefill"][0]["port"]  # port collision on one host
    r = tilepd(tmp_path / "home", "up", str(topo.write(data, tmp_path / "bad.yaml")))
    assert r.rc == 3, r
    assert tilepd(tmp_path / "home", "up", str(tmp_path / "missing.yaml")).rc == 4


def test_logs_follow_streams_and_stops_cleanly(deployed: Deployed) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, TILEPD_HOME=str(deployed.home))
    p = subprocess.Popen(
        [sys.executable, "-m", "tilepd", "logs", str(deployed.file), "--role", "router", "-f", "-n", "2"],
        stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        first = p.stdout.readline()
        assert first.startswith("127.0.0.1/router | "), first
    finally:
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=30)
    log_file = str(Path(deployed.base) / "logs" / "router.log")

    def tails() -> list[str]:
        return [c for _, c in processes_mentioning(log_file) if c.startswith("tail ")]

    wait_until(lambda: not tails(), 10.0)  # a descheduled tail may take a moment to go; a leaked one stays
    assert tails() == []


def test_api_key_reaches_the_router_and_never_the_ansible_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    secret = "sk-tilepd-test-" + "7f3a9c1e5b"
    monkeypatch.setenv("TILEPD_TEST_ROUTER_KEY", secret)
    data = topo.local_topology(tmp_path, name="t-secret")
    data["router"]["api_key"] = {"env": "TILEPD_TEST_ROUTER_KEY"}
    file = topo.write(data, tmp_path / "topology.yaml")
    home = tmp_path / "home"
    try:
        up = tilepd(home, "up", str(file), "--only", "router")
        assert up.rc == 0, up
        url = f"http://127.0.0.1:{data['router']['port']}/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {secret}"}, timeout=10).status_code == 200
        assert secret not in up.out
        # the key and the deployment secret live only in their 0600 files on the (here: local) router host
        base = Path(data["deployment"]["base_dir"])
        key_file, deploy_file = base / "secrets" / "router-api-key", base / "secrets" / "deployment"
        assert key_file.read_text().strip() == secret and oct(key_file.stat().st_mode & 0o777) == "0o600"
        deployment_secret = deploy_file.read_text().strip()
        assert len(deployment_secret) == 64 and oct(deploy_file.stat().st_mode & 0o777) == "0o600"
        secrets = [secret, deployment_secret, node_api_key(deployment_secret.encode())]
        assert leaks(secrets, [home / "t-secret", base / "logs", base / "run", base / "config", base / "env"], str(base)) == []
        assert [p for p in processes_mentioning(str(base)) if "tilepd.router" in p[1]]  # the grep saw the router process
    finally:
        tilepd(home, "down", str(file))
    assert processes_mentioning(data["deployment"]["base_dir"]) == []
