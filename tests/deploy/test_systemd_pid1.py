"""systemd mode for real: `tilepd up` with `services: systemd` on a host where systemd is PID 1.

The host (tests/deploy/systemd_host.py) is a network namespace on 10.78.0.0/24 with systemd
booted in its own PID, mount and cgroup namespaces, the way Molecule tests Ansible roles in a
systemd container; its sshd is a unit, so the deploy goes over SSH as to any host. The
topology's decode node d0 and the router run there as units; its prefill names 10.78.0.12, a
host that is never booted, and every run is `--limit 10.78.0.11` (vLLM would take minutes of
this 2-core box; the unit path is the same for it).

Shown: `up` refuses, before anything starts, while the service user cannot enter the lab's folder
(pytest makes it mode 0700), naming it; then the health gate passes, the units are active and every
process of them runs as the service user `up` created (in the host's own /etc); a second `up`
changes nothing (same MainPID, no restart); SIGKILL of the decode node's main process is undone by systemd
(Restart=on-failure) and `tilepd status` counts the restart; a decode node whose loop is wedged is
restarted by systemd's watchdog (WatchdogSec, its sd_notify pings stop); `down` stops, disables and removes
the units; the host powers off and nothing of it is left.
"""

from __future__ import annotations

import json
import pwd
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy import topo
from tests.deploy.cli import Run, processes_mentioning, tilepd
from tests.deploy import netns
from tests.deploy.stack import missing_stack_piece
from tests.deploy.systemd_host import CGROUP2, SystemdLab, missing_systemd_prerequisites

pytestmark = pytest.mark.slow

HOST, UNBOOTED = "10.78.0.11", "10.78.0.12"
DECODE_UNIT, ROUTER_UNIT = "tilepd-decode-d0.service", "tilepd-router.service"
SERVICE_USER = "tilepd"  # deployment.service_user's default
UNITS = (DECODE_UNIT, ROUTER_UNIT)


@dataclass
class Deployed:
    lab: SystemdLab
    host: netns.TestHost  # (not imported by name: pytest would try to collect a Test* class)
    root: Path
    file: Path
    first: Run
    refused: Run | None = None  # the `up` before the lab's folder was opened to the service user
    after_refusal: dict[str, str] | None = None  # unit -> its file and state right after that `up`
    down: Run | None = None

    def run(self, *args: str) -> Run:
        return tilepd(self.root / "home", *args)

    def up(self) -> Run:
        return self.run("up", str(self.file), "-y", "--limit", HOST)

    def status(self) -> dict[str, dict]:
        r = self.run("status", str(self.file), "--json")
        return {s["service"]: s for s in r.json()["services"]}

    def units(self) -> dict[str, dict[str, str]]:
        props = ("ActiveState", "SubState", "MainPID", "NRestarts", "UnitFileState", "ExecMainStartTimestampMonotonic")
        return {u: self.lab.show(self.host, u, *props) for u in UNITS}

    def host_path(self, path: str) -> Path:
        """A path as the booted host sees it (its own /etc/systemd/system, /run, /tmp)."""
        return Path(f"/proc/{self.lab.init_pid(self.host)}/root") / path.lstrip("/")


def _topology(root: Path, key: Path) -> dict:
    t = topo.lab_topology(root, key, name="t-sd-pid1")
    t["deployment"]["services"] = "systemd"
    base = str(root / "hosts" / "sd")  # one host, one base_dir
    t["decode"][0].update(address=HOST, base_dir=base)
    t["router"].update(address=HOST, base_dir=base)
    t["prefill"][0]["address"] = UNBOOTED
    return t


@pytest.fixture(scope="module")
def sd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    why = missing_systemd_prerequisites() or missing_stack_piece(prefill=False)
    if why:
        pytest.skip(f"systemd test host unavailable: {why}")
    root = tmp_path_factory.mktemp("sd-pid1")
    lab = SystemdLab(root=root)
    d = None
    try:
        t0 = time.monotonic()
        lab.start()
        print(f"boot + ssh: {time.monotonic() - t0:.1f}s")
        file = topo.write(_topology(root, lab.client_key), root / "sd.yaml")
        d = Deployed(lab, lab.hosts[0], root, file, Run([], 0, "", ""))
        assert root.stat().st_mode & 0o777 == 0o700  # pytest's: no one but root may enter
        t0 = time.monotonic()
        d.refused = d.up()
        print(f"refused up: {time.monotonic() - t0:.1f}s")
        d.after_refusal = {u: f"{d.host_path(f'/etc/systemd/system/{u}').exists()} {lab.show(lab.hosts[0], u, 'ActiveState')['ActiveState']}"
                           for u in UNITS}
        root.chmod(0o755)  # as a real host keeps /srv/tilepd: the service user may enter, the files say what it may read
        t0 = time.monotonic()
        d.first = d.up()
        print(f"first up: {time.monotonic() - t0:.1f}s")
        assert d.first.rc == 0, str(d.first)
        yield d
    finally:
        try:
            if d is not None and d.down is None:
                d.down = d.run("down", str(d.file), "-y", "--limit", HOST)
                assert d.down.rc == 0, d.down
        finally:
            lab.stop()
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"{lab.name_prefix}-{lab.tag}-" not in listed and not (CGROUP2 / f"tilepd-lab-{lab.tag}").exists()
            assert processes_mentioning(str(root)) == []


def _health_gates(d: Deployed) -> dict[str, bool]:
    """{task item: healthy} of the health-gate tasks in the newest ansible-runner run (its job events)."""
    runs = sorted((d.root / "home").glob("*/runner/artifacts/*"), key=lambda p: p.stat().st_mtime)
    gates = {}
    for f in sorted((runs[-1] / "job_events").glob("*.json")):
        ev = json.loads(f.read_text())
        data = ev.get("event_data", {})
        if ev.get("event") in ("runner_item_on_ok", "runner_on_ok") and str(data.get("task", "")).startswith("health gate: "):
            res = data.get("res", {})
            for item in res.get("results", [res]):  # one event per loop item, and the task's with every item
                if "stdout" in item:
                    gates[f"{data['task']} {item['item']['name']}"] = json.loads(item["stdout"])["healthy"]
    return gates


def test_up_refuses_what_the_service_user_cannot_read_before_anything_starts(sd: Deployed) -> None:
    refused = sd.refused
    assert refused is not None and refused.rc != 0, refused
    assert f"service user {SERVICE_USER} may not enter folder {sd.root} (mode 0700, owner root:root), so it cannot use" in refused.out, refused
    for named in ("decode-d0 weights_dir", "router tokenizer_dir", "decode-d0 working directory", "router data dir"):
        assert named in refused.out, refused
    assert "interpreter)" not in refused.out, refused  # the host's /root shows the interpreter to every user
    assert "health gate" not in refused.out and "unit files" not in refused.out, refused  # stopped in the first play
    assert sd.after_refusal == {unit: "False inactive" for unit in UNITS}  # no unit file, nothing started
    # the user was created before the check, in the host's own /etc, not the machine's
    with pytest.raises(KeyError):
        pwd.getpwnam(SERVICE_USER)


def test_every_process_of_the_units_runs_as_the_service_user(sd: Deployed) -> None:
    """Issue 26's done-when: a systemd-mode stack's services run as the service user (never root), which `up` created
    as a system user without a login shell; it owns the data dir and nothing else `up` wrote."""
    entry = sd.lab.run_in(sd.host, "getent", "passwd", SERVICE_USER).stdout.strip().split(":")
    assert len(entry) == 7, entry
    uid, gid, shell = int(entry[2]), int(entry[3]), entry[6]
    assert 0 < uid < 1000 and shell == "/usr/sbin/nologin", entry  # a system user, no login
    for unit in UNITS:
        props = sd.lab.show(sd.host, unit, "User", "Group", "ControlGroup")
        assert (props["User"], props["Group"]) == (SERVICE_USER, SERVICE_USER), props
        pids = sd.lab.run_in(sd.host, "cat", f"/sys/fs/cgroup{props['ControlGroup']}/cgroup.procs").stdout.split()
        assert pids, (unit, props)
        for pid in pids:  # the main process and every child (the decode node's TP workers would be there too)
            status = sd.lab.run_in(sd.host, "cat", f"/proc/{pid}/status").stdout
            ids = {line.split(":")[0]: [int(x) for x in line.split()[1:]] for line in status.splitlines() if line.startswith(("Uid:", "Gid:"))}
            assert ids == {"Uid": [uid] * 4, "Gid": [gid] * 4}, (unit, pid, status)
    data = sd.host_path(f"{sd.root}/hosts/sd/data").stat()
    assert (data.st_uid, data.st_gid, data.st_mode & 0o777) == (uid, gid, 0o750)
    secret = sd.host_path(f"{sd.root}/hosts/sd/secrets/deployment").stat()  # the SSH user's; systemd hands the service a copy
    assert (secret.st_uid, secret.st_mode & 0o777) == (0, 0o600)
    config = sd.host_path(f"{sd.root}/hosts/sd/config/router.json").stat()
    assert config.st_uid == 0


def test_up_passes_the_health_gate_with_active_units(sd: Deployed) -> None:
    assert sd.first.changed() > 0, sd.first
    assert _health_gates(sd) == {"health gate: decode decode-d0": True, "health gate: router router": True}
    units = sd.units()
    for unit, props in units.items():
        assert (props["ActiveState"], props["SubState"], props["UnitFileState"]) == ("active", "running", "enabled"), (unit, props)
        assert props["NRestarts"] == "0" and int(props["MainPID"]) > 0
        text = sd.host_path(f"/etc/systemd/system/{unit}").read_text()
        assert "Restart=on-failure" in text and "KillMode=control-group" in text and f"\nUser={SERVICE_USER}\n" in text
    assert not Path(f"/etc/systemd/system/{DECODE_UNIT}").exists()  # the machine's own /etc is untouched
    assert sd.lab.systemctl(sd.host, "is-system-running", check=False).stdout.strip() == "running"
    rows = sd.status()
    for name in ("decode-d0", "router"):
        row = rows[name]
        assert (row["host"], row["run"], row["healthy"], row["restarts"]) == (HOST, "running", True, 0), row
        assert str(row["pid"]) == units[f"tilepd-{name}.service"]["MainPID"]  # systemd's MainPID, read over SSH
    assert rows["prefill-p0"]["run"] == "unreachable"  # never booted: --limit kept the deploy off it


def test_second_up_changes_nothing(sd: Deployed) -> None:
    before = sd.units()
    t0 = time.monotonic()
    again = sd.up()
    print(f"second up: {time.monotonic() - t0:.1f}s")
    assert again.rc == 0 and again.changed() == 0, again
    assert sd.units() == before


def test_systemd_restarts_a_killed_decode_node_and_status_counts_it(sd: Deployed) -> None:
    old = sd.lab.show(sd.host, DECODE_UNIT, "MainPID")["MainPID"]
    t0 = time.monotonic()
    kill = sd.lab.run_in(sd.host, "kill", "-KILL", old)  # a crash, not a stop: systemd did not ask for it
    assert kill.returncode == 0, kill.stderr
    deadline = time.monotonic() + 60
    while True:
        props = sd.lab.show(sd.host, DECODE_UNIT, "ActiveState", "MainPID", "NRestarts", "Result")
        if props["NRestarts"] == "1" and props["ActiveState"] == "active" and props["MainPID"] not in ("0", old):
            break
        assert time.monotonic() < deadline, props
        time.sleep(0.5)
    deadline = time.monotonic() + 120
    while not (row := sd.status()["decode-d0"])["healthy"]:
        assert time.monotonic() < deadline, row
        time.sleep(1)
    print(f"killed -> restarted and healthy: {time.monotonic() - t0:.1f}s")
    assert (row["run"], row["restarts"], str(row["pid"])) == ("running", 1, props["MainPID"]), row
    table = sd.run("status", str(sd.file))
    line = next(line for line in table.stdout.splitlines() if "decode-d0" in line)
    assert "running (1 restart)" in line, table
    wide = sd.run("status", str(sd.file), "--wide")
    assert f"running ({props['MainPID']}) (1 restart)" in wide.stdout, wide
    log = sd.lab.run_in(sd.host, "journalctl", "-u", DECODE_UNIT, "--no-pager", "-o", "cat").stdout
    assert "Main process exited, code=killed, status=9/KILL" in log, log[-2000:]
    logs = sd.run("logs", str(sd.file), "--role", "decode", "-n", "5")  # journald's lines, over SSH
    assert logs.rc == 0 and logs.stdout.splitlines(), logs
    assert all(line.startswith(f"{HOST}/decode-d0 | ") for line in logs.stdout.splitlines()), logs
    # a service systemd brought back runs the same config: `up` leaves it alone
    again = sd.up()
    assert again.rc == 0 and again.changed() == 0, again
    assert sd.lab.show(sd.host, DECODE_UNIT, "MainPID", "NRestarts") == {"MainPID": props["MainPID"], "NRestarts": "1"}


def test_forced_up_drains_restarts_and_rejoins_the_decode_node(sd: Deployed) -> None:
    """A rolling restart in systemd mode: `up --force` drains d0 through its admin API (the router sees it draining),
    restarts its unit, gates on its health, and the router takes it back; `--force` restarts the router's unit too
    (every decode node and router, one at a time), after the decode node. (No
    prefill runs on this host, so no traffic: the zero-failure restart under load is `scripts/faults.sh -k rolling`.)"""
    old = sd.units()
    t0 = time.monotonic()
    forced = sd.run("up", str(sd.file), "-y", "--limit", HOST, "--force")
    print(f"forced up: {time.monotonic() - t0:.1f}s")
    assert forced.rc == 0 and forced.changed() >= 1, forced
    now = sd.units()
    assert now[DECODE_UNIT]["ActiveState"] == "active" and now[DECODE_UNIT]["MainPID"] not in ("0", old[DECODE_UNIT]["MainPID"])
    assert now[DECODE_UNIT]["NRestarts"] == "0"  # started by `up` (systemctl restart), which resets the crash count
    assert now[ROUTER_UNIT]["ActiveState"] == "active" and now[ROUTER_UNIT]["MainPID"] not in ("0", old[ROUTER_UNIT]["MainPID"])
    notes = sd.host_path(f"{sd.root}/hosts/sd/logs/decode-d0.log").read_text(errors="replace")
    assert "drained before the restart: idle" in notes and "restarted after a drain; healthy" in notes, notes[-2000:]
    router_log = sd.lab.run_in(sd.host, "journalctl", "-u", ROUTER_UNIT, "--no-pager", "-o", "cat").stdout
    drained_at = router_log.rfind("event=node_draining node=d0")
    assert drained_at >= 0 and router_log.find("event=node_undrained node=d0", drained_at) > 0, router_log[-3000:]
    assert sd.status()["decode-d0"]["healthy"] is True


def test_systemd_watchdog_restarts_a_wedged_decode_node(sd: Deployed) -> None:
    """A decode node whose serving loop is blocked for good (the test-only fault TILEPD_FAULT_WEDGE_LOOP_AFTER_S,
    tilepd.runtime.liveness, set by a drop-in) stops its WATCHDOG=1 pings: systemd kills it after WatchdogSec and
    Restart=on-failure starts it again, within 60 s of the wedge."""
    dropin = sd.host_path(f"/etc/systemd/system/{DECODE_UNIT}.d/wedge.conf")
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text("[Service]\nEnvironment=TILEPD_FAULT_WEDGE_LOOP_AFTER_S=5\n")
    try:
        assert sd.lab.run_in(sd.host, "systemctl", "daemon-reload").returncode == 0
        started = sd.lab.run_in(sd.host, "systemctl", "restart", DECODE_UNIT)  # returns at the node's READY=1
        assert started.returncode == 0, started.stderr
        old = sd.lab.show(sd.host, DECODE_UNIT, "MainPID")["MainPID"]
        t_wedge = time.monotonic() + 5
        deadline = t_wedge + 60
        while True:
            props = sd.lab.show(sd.host, DECODE_UNIT, "MainPID", "NRestarts")
            if props["NRestarts"] == "1" and props["MainPID"] not in ("0", old):
                break
            assert time.monotonic() < deadline, props
            time.sleep(0.5)
        print(f"wedged -> restarted by the watchdog: {time.monotonic() - t_wedge:.1f}s after the wedge")
        log = sd.lab.run_in(sd.host, "journalctl", "-u", DECODE_UNIT, "--no-pager", "-o", "cat").stdout
        assert "Watchdog timeout" in log and "event=fault_injected" in log, log[-3000:]
    finally:
        dropin.unlink(missing_ok=True)
        sd.lab.run_in(sd.host, "systemctl", "daemon-reload")
        sd.lab.run_in(sd.host, "systemctl", "restart", DECODE_UNIT)
    deadline = time.monotonic() + 120
    while not sd.status()["decode-d0"]["healthy"]:
        assert time.monotonic() < deadline
        time.sleep(1)


def test_down_stops_and_removes_the_units(sd: Deployed) -> None:
    t0 = time.monotonic()
    sd.down = sd.run("down", str(sd.file), "-y", "--limit", HOST)
    print(f"down: {time.monotonic() - t0:.1f}s")
    assert sd.down.rc == 0, sd.down
    for unit in UNITS:
        props = sd.lab.show(sd.host, unit, "ActiveState", "LoadState")
        assert props == {"ActiveState": "inactive", "LoadState": "not-found"}, (unit, props)
        assert not sd.host_path(f"/etc/systemd/system/{unit}").exists()
        assert not sd.host_path(f"/etc/systemd/system/multi-user.target.wants/{unit}").exists()
    # what still runs in the host is its own: unshare (the parent of its PID 1), systemd, journald, sshd
    comms = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in sd.lab.cgroup_pids() if Path(f"/proc/{pid}/comm").exists()}
    assert comms <= {"unshare", "systemd", "systemd-journal", "sshd", "sshd-session"}, comms
    assert processes_mentioning(str(sd.root / "hosts")) == []
