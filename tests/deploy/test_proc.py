"""Process supervisor: real detached processes, pid reuse safety, group stop, health gate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.waiting import wait_until
from tilepd.connector.launch import free_port
from tilepd.deploy import proc
from tilepd.deploy.proc import ServiceSpec

# A child that also spawns a grandchild, so stopping must take the whole group.
_SERVER = r"""
import http.server, os, subprocess, sys, signal
port = int(sys.argv[1])
if len(sys.argv) > 2 and sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): print("GET", self.path, flush=True)
print("listening", port, os.environ.get("TILEPD_TEST_MARK"), flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _spec(tmp_path: Path, *extra: str, config_hash: str = "h1", health: bool = True, **kw) -> ServiceSpec:
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    return ServiceSpec(
        name="svc",
        role="decode",
        argv=[sys.executable, str(script), str(port), *extra],
        env={"TILEPD_TEST_MARK": "mark-42"},
        cwd=tmp_path,
        log_file=tmp_path / "logs" / "svc.log",
        pid_file=tmp_path / "run" / "svc.pid",
        config_hash=config_hash,
        health_url=f"http://127.0.0.1:{port}/health" if health else None,
        health_timeout_s=20,
        **kw,
    )


@pytest.fixture
def cleanup():
    specs: list[ServiceSpec] = []
    yield specs
    for s in specs:
        proc.stop(s)


@pytest.mark.slow
def test_start_is_idempotent_and_stop_takes_the_group(tmp_path: Path, cleanup) -> None:
    spec = _spec(tmp_path)
    cleanup.append(spec)
    first = proc.start(spec)
    assert first["changed"] and first["running"] and first["action"] == "start"
    assert proc.wait_healthy(spec)["healthy"] is True
    again = proc.start(spec)
    assert again["changed"] is False and again["pid"] == first["pid"]
    pgid = first["pid"]
    assert len(proc._group_members(pgid)) == 3  # the server, its grandchild and the log pump (tilepd.deploy.logpipe)
    log = tmp_path / "logs" / "svc.log"
    wait_until(lambda: "mark-42" in log.read_text(), 10.0)  # the log pump writes on its own time, health can answer first
    assert "mark-42" in log.read_text()  # env from the spec reached it
    stopped = proc.stop(spec)
    assert stopped["changed"] and stopped["signal"] == "SIGTERM" and not stopped["running"]
    assert proc._group_members(pgid) == []
    assert not spec.pid_file.exists() and not spec.state_file.exists()
    assert proc.stop(spec)["changed"] is False


@pytest.mark.slow
def test_config_hash_change_restarts(tmp_path: Path, cleanup) -> None:
    spec = _spec(tmp_path, config_hash="old")
    cleanup.append(spec)
    pid_old = proc.start(spec)["pid"]
    new = spec.model_copy(update={"config_hash": "new"})
    cleanup.append(new)
    assert proc.status(new)["hash_matches"] is False
    check = proc.start(new, check=True)
    assert check["changed"] and check["action"] == "restart" and check["pid"] == pid_old  # --check: nothing moved
    res = proc.start(new)
    assert res["changed"] and res["action"] == "restart" and res["pid"] != pid_old
    assert proc._proc_stat(pid_old) is None or proc._proc_stat(pid_old)[0] == "Z"


@pytest.mark.slow
def test_sigterm_ignored_then_sigkill(tmp_path: Path, cleanup) -> None:
    spec = _spec(tmp_path, "ignore-term", stop_timeout_s=1.0)
    cleanup.append(spec)
    pid = proc.start(spec)["pid"]
    proc.wait_healthy(spec)  # SIGTERM handler is installed once it serves
    res = proc.stop(spec)
    assert res["signal"] == "SIGKILL" and not res["running"]
    assert proc._group_members(pid) == []


@pytest.mark.slow
def test_reused_pid_is_not_ours(tmp_path: Path) -> None:
    """A state file whose pid now belongs to another process (different start time) reads as not running."""
    spec = _spec(tmp_path)
    spec.pid_file.parent.mkdir(parents=True)
    spec.state_file.write_text(json.dumps({"pid": os.getpid(), "pgid": os.getpid(), "start_ticks": 1, "config_hash": "h1"}))
    assert proc.status(spec)["running"] is False
    assert proc.stop(spec)["changed"] is False  # and it never signals us
    assert not spec.state_file.exists()


@pytest.mark.slow
def test_wait_reports_a_dead_service_with_its_log(tmp_path: Path) -> None:
    spec = _spec(tmp_path).model_copy(update={"argv": [sys.executable, "-c", "import sys; print('boom: bad config'); sys.exit(3)"]})
    proc.start(spec)
    res = proc.wait_healthy(spec)
    assert res["failed"] and "process exited" in res["msg"]
    assert any("boom: bad config" in line for line in res["log_tail"])


@pytest.mark.slow
def test_cli_prints_one_json_line(tmp_path: Path, cleanup) -> None:
    spec = _spec(tmp_path)
    cleanup.append(spec)
    spec_file = tmp_path / "svc.spec.json"
    spec_file.write_text(spec.model_dump_json())
    run = lambda verb, *a: subprocess.run([sys.executable, "-m", "tilepd.deploy.proc", verb, "--spec", str(spec_file), *a], capture_output=True, text=True, timeout=60)  # noqa: E731 - one line, read where it is used
    out = run("start", "--check")
    assert out.returncode == 0 and json.loads(out.stdout)["changed"] is True and not spec.pid_file.exists()
    assert json.loads(run("start").stdout)["changed"] is True
    assert json.loads(run("wait").stdout)["healthy"] is True
    assert json.loads(run("start").stdout)["changed"] is False
    assert json.loads(run("status").stdout)["running"] is True
    assert json.loads(run("stop").stdout)["changed"] is True
    assert json.loads(run("status").stdout)["running"] is False
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": 1}')
    res = subprocess.run([sys.executable, "-m", "tilepd.deploy.proc", "start", "--spec", str(bad)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and json.loads(res.stdout)["failed"] is True


def _gone(pid: int) -> bool:
    st = proc._proc_stat(pid)
    return st is None or st[0] in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    return wait_until(lambda: _gone(pid), timeout_s)


@pytest.mark.slow
def test_sigkill_of_the_main_process_leaves_orphans_that_start_and_stop_end(tmp_path: Path, cleanup) -> None:
    """The service's children outlive a SIGKILL of its main process (as vLLM's EngineCore does):
    `start` ends the orphaned group and starts the service again; `stop` ends orphans too."""
    spec = _spec(tmp_path)
    cleanup.append(spec)
    pid = proc.start(spec)["pid"]
    assert proc.wait_healthy(spec)["healthy"] is True
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    orphans = proc.status(spec)["orphans"]
    # the grandchild lives on, and the log pump with it (it still logs the grandchild's output)
    assert proc.status(spec)["running"] is False and len(orphans) == 2 and pid not in orphans
    assert proc.start(spec, check=True)["action"] == "recover" and proc._group_members(pid) == orphans  # --check moves nothing
    res = proc.start(spec)
    assert res["changed"] and res["action"] == "recover" and res["orphans_ended"] == orphans and res["pid"] != pid
    assert proc._group_members(pid) == [] and proc.wait_healthy(spec)["healthy"] is True
    assert "ended 2 orphaned process(es) of group" in spec.log_file.read_text()
    second = res["pid"]
    os.kill(second, signal.SIGKILL)
    assert _wait_gone(second) and len(proc._group_members(second)) == 2
    stopped = proc.stop(spec)
    assert stopped["changed"] and len(stopped["orphans"]) == 2 and not stopped["running"]
    assert proc._group_members(second) == []


@pytest.mark.slow
def test_a_changed_secret_file_restarts_the_service(tmp_path: Path, cleanup) -> None:
    secret = tmp_path / "secret"
    secret.write_text("one" * 20)
    spec = _spec(tmp_path, secret_files=[secret])
    cleanup.append(spec)
    first = proc.start(spec)
    assert proc.start(spec)["changed"] is False
    state = spec.state_file.read_text()
    assert "one" * 20 not in state and json.loads(state)["secrets_fingerprint"]
    secret.write_text("two" * 20)
    res = proc.start(spec)
    assert res["changed"] and res["action"] == "restart" and res["pid"] != first["pid"]


def _install_standin(site: Path, version: str) -> None:
    """A stand-in distribution on the service's PYTHONPATH (the test cannot install two vLLM releases): its
    dist-info is what `pip install -U` would replace, and what importlib.metadata reads."""
    for old in site.glob("tilepd_upgrade_standin-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    d = site / f"tilepd_upgrade_standin-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tilepd-upgrade-standin\nVersion: {version}\n")


@pytest.mark.slow
def test_an_upgraded_package_restarts_the_service_and_says_which(tmp_path: Path, cleanup) -> None:
    site = tmp_path / "site"
    _install_standin(site, "0.32.0")
    spec = _spec(tmp_path, packages=["tilepd-upgrade-standin", "not-installed-anywhere"])
    spec = spec.model_copy(update={"env": {**spec.env, "PYTHONPATH": str(site)}})
    cleanup.append(spec)
    first = proc.start(spec)
    state = json.loads(spec.state_file.read_text())
    assert state["package_versions"] == {"tilepd-upgrade-standin": "0.32.0", "not-installed-anywhere": None}
    assert proc.start(spec)["changed"] is False  # same versions: left alone
    _install_standin(site, "0.33.1")
    check = proc.start(spec, check=True)
    assert check["action"] == "restart" and check["pid"] == first["pid"]
    assert check["upgraded"] == {"tilepd-upgrade-standin": {"running": "0.32.0", "installed": "0.33.1"}}
    res = proc.start(spec)
    assert res["changed"] and res["action"] == "restart" and res["pid"] != first["pid"] and "upgraded" in res
    assert json.loads(spec.state_file.read_text())["package_versions"]["tilepd-upgrade-standin"] == "0.33.1"
    assert "restarting: tilepd-upgrade-standin 0.32.0 -> 0.33.1" in spec.log_file.read_text()
    assert proc.start(spec)["changed"] is False


def test_the_plan_names_the_packages_whose_upgrade_restarts_a_service(repo_root: Path) -> None:
    from tilepd.deploy.inventory import service_spec
    from tilepd.plan import build_plan
    from tilepd.topology import load_topology

    plan = build_plan(load_topology(repo_root / "topology_examples" / "local.yaml"))
    by_role = {s.role: service_spec(plan, s).packages for h in plan.hosts for s in h.services if s.kind == "daemon"}
    assert by_role == {"prefill": ["vllm"], "decode": ["torch"], "router": []}


def _stranger_state(pid: int, case: str) -> dict:
    """A state file naming an unrelated live process as it would read after a reboot, a pid reuse or an old tilepd."""
    st = proc._proc_stat(pid)
    assert st is not None
    base = {"pid": pid, "pgid": pid, "config_hash": "h1"}
    if case == "other-boot":  # pid and start time match (the worst case), written on another boot
        return {**base, "start_ticks": st[2], "boot_id": "00000000-0000-0000-0000-000000000000", "owner_token": "feedface"}
    if case == "no-marker":  # this boot, pid and start time match, but the process does not carry the service's token
        return {**base, "start_ticks": st[2], "boot_id": proc.boot_id(), "owner_token": "feedface"}
    return {**base, "start_ticks": st[2] + 1}  # "legacy": a state file without boot id or token whose main process is gone


@pytest.mark.slow
@pytest.mark.parametrize("case", ["other-boot", "no-marker", "legacy"])
def test_a_stale_state_file_never_signals_an_unrelated_process(tmp_path: Path, case: str) -> None:
    """An unrelated process in its own session (what `setsid sleep` makes) that a stale state file names as the
    service's pid and process group: `status` says not running and why, `stop` and `start` leave it alive."""
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        spec = _spec(tmp_path, health=False)
        spec.pid_file.parent.mkdir(parents=True)
        spec.state_file.write_text(json.dumps(_stranger_state(stranger.pid, case)))
        st = proc.status(spec)
        assert st["running"] is False and st["orphans"] == [] and st["not_ours"], st
        stopped = proc.stop(spec)
        assert stopped["changed"] is False and stopped["not_ours"] == st["not_ours"]
        assert stranger.poll() is None, "stop signalled a process it did not start"
        assert "event=not_ours" in spec.log_file.read_text()
        spec.state_file.write_text(json.dumps(_stranger_state(stranger.pid, case)))
        started = proc.start(spec)
        try:
            assert started["action"] == "start" and started["not_ours"] and started["pid"] != stranger.pid
            assert stranger.poll() is None, "start ended a process it did not start"
        finally:
            proc.stop(spec)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.slow
def test_the_state_records_boot_id_and_a_marker_every_process_of_the_service_carries(tmp_path: Path, cleanup) -> None:
    spec = _spec(tmp_path)
    cleanup.append(spec)
    pid = proc.start(spec)["pid"]
    assert proc.wait_healthy(spec)["healthy"] is True
    state = json.loads(spec.state_file.read_text())
    assert state["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert state["start_ticks"] == int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    members = proc._group_members(pid)
    assert len(members) == 3 and all(proc._carries_token(p, state["owner_token"]) for p in members)


def _fake_environ(monkeypatch: pytest.MonkeyPatch, reads: list[bytes]) -> list[int]:
    """Makes `_carries_token` read `reads` in turn (the last one for good); returns the pids it was asked for."""
    asked: list[int] = []

    def read(pid: int) -> bytes:
        asked.append(pid)
        return reads[min(len(asked), len(reads)) - 1]

    monkeypatch.setattr(proc, "_read_environ", read)
    return asked


def test_an_empty_environ_is_read_again_as_a_process_mid_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a process execs (logpipe execs the service in the pid `start` returned) the kernel shows an empty
    /proc/PID/environ; read then, the service looked gone and `wait_healthy` failed it ("main process N was gone").
    The reads here are a fake: the kernel's exec window cannot be produced on demand. The pid is this live process."""
    marker = f"{proc.OWNER_ENV}=tok".encode()
    asked = _fake_environ(monkeypatch, [b"", b"", marker + b"\0PATH=/bin\0"])
    assert proc._carries_token(os.getpid(), "tok") is True and len(asked) == 3
    # a non-empty environ without the marker is not ours at once, without another read
    asked = _fake_environ(monkeypatch, [b"PATH=/bin\0" + f"{proc.OWNER_ENV}=other".encode() + b"\0"])
    assert proc._carries_token(os.getpid(), "tok") is False and len(asked) == 1

    def unreadable(pid: int) -> bytes:
        raise PermissionError(pid)

    monkeypatch.setattr(proc, "_read_environ", unreadable)
    assert proc._carries_token(os.getpid(), "tok") is False


def test_an_environ_that_stays_empty_is_not_ours_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live process whose environ stays empty (a fake read, as above) is not ours once the exec's grace is over;
    a process that is gone (or a zombie: its memory is released, its environ empty) is not ours at once."""
    monkeypatch.setattr(proc, "ENVIRON_EXEC_WAIT_S", 0.3)
    asked = _fake_environ(monkeypatch, [b""])
    t0 = time.monotonic()
    assert proc._carries_token(os.getpid(), "tok") is False
    took = time.monotonic() - t0
    assert 0.3 <= took < 10 and len(asked) >= 2, (took, len(asked))
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: the pid names nothing (a reuse within this test is next to impossible)
    asked = _fake_environ(monkeypatch, [b""])
    assert proc._carries_token(gone.pid, "tok") is False and len(asked) == 1
