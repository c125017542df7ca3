"""A test host booted with systemd as PID 1, reached over SSH like any host.

The lab network of tests/deploy/netns.py (a network namespace with a veth into a bridge), with
one difference: inside the host's network namespace, tests/deploy/systemd_boot.sh makes new PID,
mount, cgroup, UTS and IPC namespaces and execs /usr/bin/systemd, the way Molecule or
systemd-nspawn boot a container. The host's sshd is a unit of that systemd, so ansible (and
`tilepd status`) reach it by SSH, and `services: systemd` deploys real units into it.

What the booted systemd may touch is fenced in (systemd_boot.sh): tmpfs /tmp, /var/tmp, /run,
/etc/systemd/system and journal; a copy of /etc (the deploy creates the service user in the host's
passwd and group, never the machine's); only the units written here (the distribution's *.wants
directories and generators are hidden, the dangerous rest masked); read-only /sys and /proc/sys;
a cgroup2 tree rooted at a cgroup made for this host (`tilepd-lab-<tag>`), no other hierarchy.
The host's /root is a tmpfs any user may enter holding only the interpreter's trees (read-only):
this machine keeps its venv and Python under /root (mode 700), where the deployment's service user
could not run them; a real host keeps them in /opt or /usr (home_trees).
The lab root (a pytest tmp dir under the machine's /tmp) is moved into the private /tmp at the
same path, so topology paths under it mean the same file inside and out.

Teardown: SIGRTMIN+4 (systemd's "poweroff") to the host's PID 1, which stops every unit and
exits, taking its PID namespace with it; then SIGKILL for anything left in the network
namespace, the cgroup subtree removed depth-first, the namespaces and links deleted. A run
killed before its teardown is cleaned up by the next one (remove_stale_labs with this kind's
prefix and cgroups).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.netns import SSHD, LabNetwork, TestHost, missing_prerequisites, remove_stale_labs

BOOT = Path(__file__).with_name("systemd_boot.sh")
# the checkout under test: the cached venv is shared by every checkout on a machine and its editable
# install points at whichever bootstrapped last (scripts/test.sh), so the host's SSH sessions and units
# get this checkout first on PYTHONPATH, as every process the tests start locally does
REPO = Path(__file__).resolve().parents[2]
SYSTEMD = Path("/usr/bin/systemd")


def _cgroup2_root() -> Path:
    """Where this machine mounts its cgroup2 hierarchy: /sys/fs/cgroup (unified layout) or
    /sys/fs/cgroup/unified (hybrid, e.g. Debian 12 in a container without systemd as init)."""
    unified = Path("/sys/fs/cgroup")
    return unified if (unified / "cgroup.controllers").exists() else unified / "unified"


CGROUP2 = _cgroup2_root()
SSHD_UNIT = "tilepd-lab-sshd.service"
NAME_PREFIX = "tsd"

# units of the distribution that must not run in a test host even when something pulls them in:
# they write the machine's files (tmpfiles wiped a shared /tmp once), kernel settings, devices or clock
MASKED = (
    "systemd-tmpfiles-setup.service", "systemd-tmpfiles-clean.timer", "systemd-tmpfiles-clean.service",
    "systemd-tmpfiles-setup-dev.service", "systemd-tmpfiles-setup-dev-early.service", "systemd-sysctl.service",
    "systemd-modules-load.service", "systemd-udevd.service", "systemd-udevd-control.socket", "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service", "systemd-udev-settle.service", "systemd-random-seed.service", "systemd-sysusers.service",
    "systemd-firstboot.service", "systemd-machine-id-commit.service", "systemd-update-utmp.service",
    "systemd-update-utmp-runlevel.service", "systemd-journal-flush.service", "systemd-journald-audit.socket",
    "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount", "systemd-timesyncd.service", "systemd-logind.service",
    "systemd-remount-fs.service", "systemd-pstore.service", "systemd-repart.service", "systemd-hwdb-update.service",
    "systemd-journal-catalog-update.service", "systemd-update-done.service", "kmod-static-nodes.service", "ldconfig.service",
    "systemd-fsck-root.service", "systemd-boot-update.service", "getty@.service", "console-getty.service", "getty.target",
    "ssh.service", "cron.service", "dbus.service", "dbus.socket", "postgresql.service", "e2scrub_reap.service",
    "apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer", "dpkg-db-backup.timer", "man-db.timer",
)  # fmt: skip
# what the host does want from the distribution: journald (the units log there; `tilepd logs` reads it)
WANTED_SOCKETS = ("systemd-journald.socket", "systemd-journald-dev-log.socket")


def home_trees() -> list[str]:
    """The interpreter's trees (its venv and the Python that venv was made from) where they lie under /root, which the
    machine keeps mode 700: the host's /root shows them, read-only, to every user (systemd_boot.sh), as a real host
    keeps its interpreters where the service user may run them. Nothing else of the machine's /root is there."""
    trees = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)})
    under_root = [t for t in trees if Path(t).is_relative_to("/root") and t != "/root"]
    return [t for t in under_root if not any(t != o and Path(t).is_relative_to(o) for o in under_root)]


def _masked_checkout() -> list[str]:
    """The checkout, when it lies under a folder the booted host replaces with its own tmpfs (/tmp, /var/tmp): it is
    carried into the host at the same path, as the lab root is (a fresh clone in /tmp must still run there)."""
    return [str(REPO)] if any(REPO.is_relative_to(d) for d in (Path("/tmp"), Path("/var/tmp"))) else []


def missing_systemd_prerequisites() -> str | None:
    """Why a systemd test host cannot boot here, or None when it can."""
    why = missing_prerequisites()
    if why:
        return why
    for tool in ("unshare", "nsenter", "systemctl"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian: util-linux / systemd)"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} not installed (Debian package: systemd)"
    if not (CGROUP2 / "cgroup.procs").exists():
        return "no cgroup2 hierarchy mounted (neither /sys/fs/cgroup nor /sys/fs/cgroup/unified)"
    return None


def _cgroup(tag: str) -> Path:
    return CGROUP2 / f"tilepd-lab-{tag}"


def _remove_cgroup(path: Path, timeout_s: float = 10) -> None:
    """rmdir a cgroup subtree depth-first (it empties as its last processes are reaped)."""
    deadline = time.monotonic() + timeout_s
    while path.exists():
        dirs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, path]:
            try:
                d.rmdir()
            except OSError:
                pass
        if not path.exists() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if path.exists():
        raise RuntimeError(f"cgroup {path} still holds processes: {_cgroup_pids(path)}")


def _cgroup_pids(path: Path) -> list[int]:
    pids: list[int] = []
    for procs in path.rglob("cgroup.procs"):
        try:
            pids += [int(p) for p in procs.read_text().split()]
        except OSError:
            pass
    return pids


def _kill_cgroup(tag: str) -> None:
    """A stale host: SIGKILL whatever its cgroup still holds, then remove the cgroup."""
    path = _cgroup(tag)
    if not path.exists():
        return
    for pid in _cgroup_pids(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _remove_cgroup(path)


@dataclass
class SystemdLab(LabNetwork):
    """One SSH host (10.78.0.11 by default) booted with systemd as PID 1."""

    addresses: tuple[str, ...] = ("10.78.0.11",)
    gateway: str = "10.78.0.1"
    name_prefix: str = NAME_PREFIX
    boot_timeout_s: float = 60
    _boots: dict[str, subprocess.Popen] = field(default_factory=dict)
    _init_pids: dict[str, int] = field(default_factory=dict)

    # --- boot / shutdown ------------------------------------------------------------------

    def remove_stale(self) -> list[str]:
        tags = {p.name.removeprefix("tilepd-lab-") for p in CGROUP2.glob("tilepd-lab-*")}
        return remove_stale_labs(self.name_prefix, extra_tags=tags, cleanup=_kill_cgroup)

    def _write_sshd_config(self, name: str, address: str, netns: str) -> TestHost:
        host = super()._write_sshd_config(name, address, netns)
        with open(host.sshd_config, "a") as f:
            f.write(f"SetEnv PYTHONPATH={REPO}\n")  # ansible's and `tilepd status`'s helpers on the host
        return host

    def _units_dir(self, host: TestHost) -> Path:
        """The unit directory the host boots with (copied into its private /etc/systemd/system)."""
        units = self.root / host.name / "units"
        units.mkdir(parents=True, exist_ok=True)
        for name in MASKED:
            (units / name).symlink_to("/dev/null")
        (units / "sockets.target.wants").mkdir()
        for name in WANTED_SOCKETS:
            (units / "sockets.target.wants" / name).symlink_to(f"/usr/lib/systemd/system/{name}")
        (units / SSHD_UNIT).write_text(
            "\n".join(
                [
                    "[Unit]",
                    f"Description=sshd of the tilepd test host {host.address}",
                    "[Service]",
                    f"ExecStart={SSHD} -D -f {host.sshd_config}",
                    "RuntimeDirectory=sshd",  # privilege separation directory
                    "Restart=on-failure",
                    "[Install]",
                    "WantedBy=multi-user.target",
                    "",
                ]
            )
        )
        (units / "multi-user.target.wants").mkdir()
        (units / "multi-user.target.wants" / SSHD_UNIT).symlink_to(f"/etc/systemd/system/{SSHD_UNIT}")
        return units

    def boot(self, host: TestHost) -> int:
        """Boot systemd in the host's namespace; returns the pid (in this namespace) of its PID 1."""
        cgroup = _cgroup(self.tag)
        cgroup.mkdir(exist_ok=True)
        units = self._units_dir(host)
        log = open(self.root / host.name / "boot.log", "ab")
        with log:
            proc = subprocess.Popen(
                ["bash", str(BOOT), "outer", str(cgroup), host.netns, str(self.root), str(units), ":".join(home_trees()), *_masked_checkout()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self._boots[host.name] = proc
        deadline = time.monotonic() + self.boot_timeout_s
        init = None
        while init is None:
            # unshare (the Popen's pid, after two execs) forks the namespace's PID 1, which execs systemd
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            kids = children.read_text().split() if children.exists() else []
            if kids and Path(f"/proc/{kids[0]}/exe").resolve() == SYSTEMD.resolve():
                init = int(kids[0])
            elif proc.poll() is not None:
                raise RuntimeError(f"boot of {host.name} exited {proc.returncode}: {self.boot_log(host)}")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"systemd did not start in {host.name} within {self.boot_timeout_s:.0f}s: {self.boot_log(host)}")
            else:
                time.sleep(0.05)
        self._init_pids[host.name] = init
        private = Path(f"/proc/{init}/root/run/systemd/private")  # systemctl's socket, in the host's /run
        while not private.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"systemd in {host.name} opened no {private.relative_to(f'/proc/{init}/root')}: {self.boot_log(host)}")
            time.sleep(0.05)
        r = subprocess.run(
            self.nsenter_argv(host, "systemctl", "is-system-running", "--wait"),
            capture_output=True, text=True, timeout=max(1, deadline - time.monotonic()),
        )  # fmt: skip
        state = r.stdout.strip()
        self.systemctl(host, "set-environment", f"PYTHONPATH={REPO}")  # the units the deploy installs
        if state != "running":
            failed = self.systemctl(host, "list-units", "--failed", "--no-legend", check=False).stdout
            raise RuntimeError(f"systemd in {host.name} is {state!r} ({r.stderr.strip()}), not running; failed units: "
                               f"{failed.strip()}\n{self.boot_log(host)}")
        return init

    def boot_log(self, host: TestHost, n: int = 30) -> str:
        try:
            return "\n".join((self.root / host.name / "boot.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def init_pid(self, host: TestHost) -> int:
        return self._init_pids[host.name]

    def shutdown(self, host: TestHost, timeout_s: float = 60) -> None:
        """Power the host off: systemd stops every unit and exits; SIGKILL what is left after timeout_s."""
        self._shutdown(host.name, host.netns, timeout_s)
        host.sshd_pid = None

    def _shutdown(self, name: str, netns: str, timeout_s: float = 60) -> None:
        proc = self._boots.pop(name, None)
        init = self._init_pids.pop(name, None)
        if proc is None:
            return
        if init is not None and proc.poll() is None:
            try:
                os.kill(init, signal.SIGRTMIN + 4)  # systemd: start poweroff.target
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_leftovers(netns)
            proc.wait(timeout=30)

    def stop(self) -> None:
        try:
            for name in list(self._boots):  # also a host whose boot failed half-way (not in self.hosts)
                self._shutdown(name, f"{self.name_prefix}-{self.tag}-{name}")
        finally:
            super().stop()  # SIGKILL for anything left in the namespaces, then the namespaces and links
            if _cgroup(self.tag).exists():
                _kill_cgroup(self.tag)

    # --- LabNetwork's sshd hooks: sshd is a unit of the host's systemd --------------------

    def start_sshd(self, host: TestHost) -> None:
        if host.name not in self._init_pids:
            self.boot(host)
        else:
            self.systemctl(host, "start", SSHD_UNIT)
        host.sshd_pid = int(self.show(host, SSHD_UNIT, "MainPID")["MainPID"])  # in the host's PID namespace

    def stop_sshd(self, host: TestHost) -> None:
        """Stopping the unit ends the listener and every session (one cgroup), as a host going off SSH."""
        if host.name in self._init_pids:
            self.systemctl(host, "stop", SSHD_UNIT)
        host.sshd_pid = None

    # --- commands inside the host ---------------------------------------------------------

    def nsenter_argv(self, host: TestHost, *argv: str) -> list[str]:
        """argv that runs a command in every namespace of the host (its systemd, its /proc, its /run)."""
        return ["nsenter", "-t", str(self.init_pid(host)), "-a", *argv]

    def run_in(self, host: TestHost, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.nsenter_argv(host, *argv), capture_output=True, text=True, timeout=timeout)

    def systemctl(self, host: TestHost, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = self.run_in(host, "systemctl", *args)
        if check and r.returncode != 0:
            raise RuntimeError(f"systemctl {' '.join(args)} in {host.name}: rc {r.returncode}: {r.stderr.strip()}")
        return r

    def show(self, host: TestHost, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show -p PROP ... UNIT` as a dict."""
        argv = ["show", unit, *(a for p in props for a in ("-p", p))]
        out = self.systemctl(host, *argv).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def cgroup_pids(self) -> list[int]:
        """Every process (pids of this namespace) in the lab's cgroup tree."""
        return _cgroup_pids(_cgroup(self.tag))

