"""systemd mode, statically: the units the playbook installs pass `systemd-analyze verify`, carry
the restart policy, env file and (for RDMA transports) unlimited locked memory; the playbook's
systemd path runs in --check without touching the machine's /etc.

The units run for real in tests/deploy/test_systemd_pid1.py, on a test host booted with
systemd as PID 1 (tests/deploy/systemd_host.py): up, health gate, idempotence, a restart by
Restart=on-failure counted in `tilepd status`, down."""

from __future__ import annotations

import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy import topo
from tests.deploy.cli import tilepd
from tilepd.deploy import deployment, proc
from tilepd.deploy.status import ServiceStatus, state_text


def _systemd(data: dict) -> dict:
    data["deployment"]["services"] = "systemd"
    return data


def _units(tmp_path: Path, data: dict) -> list[Path]:
    dep = deployment.load(topo.write(data, tmp_path / f"{data['deployment']['name']}.yaml"), state_dir=tmp_path / data["deployment"]["name"])
    deployment.render(dep)
    return sorted((dep.render_dir / "hosts").rglob("units/*.service"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (Debian package: systemd)")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    local = _units(tmp_path, _systemd(topo.local_topology(tmp_path / "l", name="t-sd-local")))
    lab = _units(tmp_path, _systemd(topo.lab_topology(tmp_path / "lab", tmp_path / "key", name="t-sd-lab")))
    rdma = topo.local_topology(tmp_path / "n", name="t-sd-nixl")
    rdma["transport"] = {"name": "nixl"}
    nixl = _units(tmp_path, _systemd(rdma))
    units = local + lab + nixl
    assert len(units) >= 12
    r = subprocess.run(["systemd-analyze", "verify", *map(str, units)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    decode_units = 0
    for unit in units:
        text = unit.read_text()
        assert "EnvironmentFile=" in text and "ExecStart=/" in text
        if "Type=simple" in text or "Type=notify" in text:
            assert "Restart=on-failure" in text and "KillMode=control-group" in text  # orphans die with the unit
        # a decode node pings systemd from its serving loop (tilepd.runtime.liveness): a wedged one is restarted
        role = text.split("Description=", 1)[1].split(": ", 1)[1].split()[0]
        if role == "decode":
            decode_units += 1
            assert "Type=notify" in text and "NotifyAccess=main" in text and "WatchdogSec=30" in text, text
        else:
            assert "WatchdogSec" not in text, text
    assert decode_units >= 3
    for unit in units:  # the sandbox (issue 26): every unit hardened, daemons read-only but their base dir
        text = unit.read_text()
        assert "NoNewPrivileges=yes" in text and "ProtectKernelModules=yes" in text and "RestrictSUIDSGID=yes" in text, text
        assert "\nUser=tilepd\nGroup=tilepd\n" in text, text  # the service user (deployment.service_user's default), never root
        if "Type=oneshot" not in text:
            cwd = text.split("WorkingDirectory=", 1)[1].split("\n", 1)[0]
            # writes only to its data dir (the service user's), HOME and caches there
            assert "ProtectSystem=strict" in text and f"\nReadWritePaths={cwd}/data\n" in text and "ProtectHome=read-only" in text, text
            assert f"Environment=HOME={cwd}/data XDG_CACHE_HOME={cwd}/data/cache " in text, text
            # the service user's copy of the deployment secret (`up` writes it), shown at the secret's own path (the file
            # stays the SSH user's, 0600)
            assert f"\nBindReadOnlyPaths={cwd}/data/secrets/deployment:{cwd}/secrets/deployment\n" in text, text
            assert "\nCapabilityBoundingSet=\n" in text, text  # no capability: no port below 1024 in these topologies
            assert "PrivateTmp=yes" not in text  # these test topologies live under /tmp: a private one would hide them
            assert f"\nEnvironment=TMPDIR={cwd}/data\n" in text, text  # the machine's /tmp is read-only to it
    exposure = {u: _exposure(u) for u in units if "Type=oneshot" not in u.read_text()}
    # 9.6 UNSAFE each before the sandbox; 5.3 (decode, prefill) and 4.6 (router) with it but as root
    assert exposure and all(e <= 5.0 for e in exposure.values()), {str(u.relative_to(tmp_path)): e for u, e in exposure.items()}
    assert all("LimitMEMLOCK=infinity" in u.read_text() for u in nixl)


def _exposure(unit: Path) -> float:
    """`systemd-analyze security`'s overall exposure of a unit file (0 safest, 10 least safe)."""
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode in (0, 1), r.stderr  # 1: above its default threshold
    return float(r.stdout.split("Overall exposure level for", 1)[1].split(":", 1)[1].split()[0])


def test_the_sandbox_fits_where_the_service_lives() -> None:
    """A daemon whose paths are outside /tmp gets a private /tmp; a port below 1024 keeps the one capability to bind it."""
    from tilepd.plan.model import Service
    from tilepd.plan.systemd import sandbox

    def svc(role: str, base: str, ports: dict[str, int]) -> Service:
        return Service(name=role, role=role, kind="daemon", stage=1, creates=None, argv=[f"{base}/venv/bin/python", "-m", "x"], env={},
                       cwd=base, health=None, ports=ports, python=f"{base}/venv/bin/python", log_file=f"{base}/logs/x.log",
                       pid_file=f"{base}/run/x.pid", unit="x.service", config_file=None, config={"weights_dir": "/srv/w"},
                       config_hash="sha256:0")

    router = sandbox(svc("router", "/srv/tilepd", {"http": 443}))
    assert "PrivateTmp=yes" in router and "PrivateDevices=yes" in router, router
    assert "CapabilityBoundingSet=CAP_NET_BIND_SERVICE" in router and "AmbientCapabilities=CAP_NET_BIND_SERVICE" in router
    decode = sandbox(svc("decode", "/srv/tilepd", {"http": 8000}))
    assert "CapabilityBoundingSet=" in decode and "PrivateDevices=yes" not in decode  # GPUs and RDMA devices stay visible
    assert "PrivateTmp=yes" not in sandbox(svc("decode", "/tmp/t", {"http": 8000}))
    assert not any(line.startswith("Environment=TMPDIR") for line in decode)  # a private /tmp is writable


def test_each_secret_is_shown_at_its_own_path_from_the_service_users_copy() -> None:
    """The deployment secret and an operator's key file elsewhere (a space and a % in its name) each get a copy in the
    data dir, bound read-only over the original path, quoted and %-escaped as systemd reads them back."""
    from tilepd.plan.model import Service
    from tilepd.plan.systemd import sandbox, secret_copies

    base = "/srv/tilepd"
    router = Service(name="router", role="router", kind="daemon", stage=4, creates=None, argv=[f"{base}/venv/bin/python"], env={}, cwd=base,
                     health=None, ports={"http": 8080}, python=f"{base}/venv/bin/python", log_file="/l", pid_file="/p", unit="tilepd-router.service",
                     config_file=None, config={"secret_file": f"{base}/secrets/deployment", "api_key_file": "/etc/keys/router 100%.key"},
                     config_hash="sha256:0")
    assert secret_copies(router) == [(f"{base}/secrets/deployment", f"{base}/data/secrets/deployment"),
                                     ("/etc/keys/router 100%.key", f"{base}/data/secrets/etc_keys_router_100_.key")]
    binds = [line for line in sandbox(router) if line.startswith("BindReadOnlyPaths=")]
    assert binds == [f"BindReadOnlyPaths={base}/data/secrets/deployment:{base}/secrets/deployment",
                     f'BindReadOnlyPaths={base}/data/secrets/etc_keys_router_100_.key:"/etc/keys/router 100%%.key"'], binds


@pytest.mark.slow
def test_systemd_playbook_path_in_check_mode_touches_nothing(tmp_path: Path) -> None:
    """`up --check` in systemd mode runs the service user's check for real (as `nobody` while the user does not exist):
    pytest's tmp dirs are mode 0700, so it stops there, naming the folder, before any unit, user or file is made."""
    data = _systemd(topo.local_topology(tmp_path, name="t-sd-check"))
    file = topo.write(data, tmp_path / "sd.yaml")
    r = tilepd(tmp_path / "home", "up", str(file), "--check", "--only", "router")
    assert r.rc != 0, r
    blocked = [str(p) for p in (tmp_path, *tmp_path.parents) if p.stat().st_mode & 0o001 == 0]  # folders others may not enter
    assert blocked and any(f"service user tilepd may not enter folder {b} (mode " in r.out for b in blocked), r
    assert "checked as nobody: tilepd does not exist yet" in r.out, r
    assert not Path("/etc/systemd/system/tilepd-router.service").exists()
    assert not Path(data["deployment"]["base_dir"]).exists()
    with pytest.raises(KeyError):
        pwd.getpwnam("tilepd")


def test_status_reports_systemds_restart_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`proc status` of a unit reads NRestarts; the status table says `running (2 restarts)`."""
    spec = proc.ServiceSpec(name="decode-d0", role="decode", argv=["true"], cwd=tmp_path, log_file=tmp_path / "l",
                            pid_file=tmp_path / "decode-d0.pid", config_hash="sha256:x", mode="systemd", unit="tilepd-decode-d0.service")
    shown = "ActiveState=active\nMainPID=4242\nNRestarts=2\n"
    monkeypatch.setattr(proc, "_systemctl", lambda *a: subprocess.CompletedProcess(["systemctl", *a], 0, shown, ""))
    st = proc.status(spec)
    assert (st["running"], st["pid"], st["restarts"]) == (True, 4242, 2)
    row = ServiceStatus(host="h", service="decode-d0", role="decode", run="running", pid=4242, restarts=st["restarts"])
    assert state_text(row) == "running (2 restarts)"
    assert state_text(ServiceStatus(host="h", service="s", role="router", run="running", restarts=0)) == "running"
    assert state_text(ServiceStatus(host="h", service="s", role="router", run="running", restarts=1)) == "running (1 restart)"
