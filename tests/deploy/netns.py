"""Test hosts on one machine: network namespaces on a bridge, each with its own sshd.

Each host gets a namespace with a veth into a bridge in the root namespace, an address
from the lab topology (10.77.0.11/.12/.13), and a Debian sshd started inside it with
its own host key, a generated client key, `UsePAM no` and a PidFile. Namespaces share
the filesystem and the process table with the machine, so teardown stops exactly the
sshd processes started here (by pid) and deletes exactly the namespaces created here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def missing_prerequisites() -> str | None:
    """Why the namespace fixture cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "ssh-keygen", SSHD):
        if shutil.which(tool) is None and not Path(tool).exists():
            return f"{tool} not installed (Debian: iproute2 / openssh-server)"
    probe = f"tpdprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


@dataclass
class TestHost:
    name: str
    address: str
    netns: str
    base_dir: Path
    sshd_config: Path
    sshd_pid_file: Path
    sshd_pid: int | None = None

    def exec_argv(self, *argv: str) -> list[str]:
        """argv that runs a command inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class LabNetwork:
    """Three (or N) SSH-reachable hosts on this machine."""

    root: Path
    addresses: tuple[str, ...] = ("10.77.0.11", "10.77.0.12", "10.77.0.13")
    prefix: int = 24
    gateway: str = "10.77.0.1"
    user: str = "root"
    # names of the namespaces ({name_prefix}-{tag}-hostN) and links ({name_prefix}br{tag}, ...{tag}vN): a lab of
    # another kind (tests/deploy/systemd_host.py) takes its own prefix and subnet, so the two never meet
    name_prefix: str = "tpd"
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    hosts: list[TestHost] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.name_prefix}br{self.tag}"

    @property
    def client_key(self) -> Path:
        return self.root / "client_key"

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> "LabNetwork":
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_stale()
        _claim(self.tag)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.client_key)], check=True)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        _ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        _ip("addr", "add", f"{self.gateway}/{self.prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, address in enumerate(self.addresses, start=1):
            self.hosts.append(self._add_host(f"host{i}", address, i))
        for h in self.hosts:
            self._wait_ssh(h)
        return self

    def remove_stale(self) -> list[str]:
        """Remove what killed runs left of labs of this kind (remove_stale_labs)."""
        return remove_stale_labs(self.name_prefix)

    def _add_host(self, name: str, address: str, index: int) -> TestHost:
        netns = self._add_namespace(name, address, index)
        host = self._write_sshd_config(name, address, netns)
        self.start_sshd(host)
        return host

    def _add_namespace(self, name: str, address: str, index: int) -> str:
        """A network namespace with `address` on a veth into the bridge; returns its name."""
        netns = f"{self.name_prefix}-{self.tag}-{name}"
        subprocess.run(["ip", "netns", "add", netns], check=True)
        self._namespaces.append(netns)
        outer, inner = f"{self.name_prefix}{self.tag}v{index}", f"{self.name_prefix}{self.tag}p{index}"
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._links.append(outer)
        _ip("link", "set", inner, "netns", netns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("addr", "add", f"{address}/{self.prefix}", "dev", inner, netns=netns)
        _ip("link", "set", inner, "up", netns=netns)
        _ip("route", "add", "default", "via", self.gateway, netns=netns)
        return netns

    def _write_sshd_config(self, name: str, address: str, netns: str) -> TestHost:
        """The host's sshd files (host key, authorized_keys, sshd_config) under the lab root."""
        base = self.root / name
        etc = base / "sshd"
        etc.mkdir(parents=True)
        host_key = etc / "host_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
        authorized = etc / "authorized_keys"
        authorized.write_text(self.client_key.with_suffix(".pub").read_text())
        authorized.chmod(0o600)
        host = TestHost(name=name, address=address, netns=netns, base_dir=base / "deploy", sshd_config=etc / "sshd_config", sshd_pid_file=etc / "sshd.pid")
        host.sshd_config.write_text(
            "\n".join(
                [
                    f"ListenAddress {address}",
                    "Port 22",
                    f"HostKey {host_key}",
                    f"AuthorizedKeysFile {authorized}",
                    f"PidFile {host.sshd_pid_file}",
                    "UsePAM no",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "StrictModes no",
                    "MaxStartups 50:30:100",
                    "MaxSessions 50",
                    f"Subsystem sftp {SFTP_SERVER}",
                    "",
                ]
            )
        )
        return host

    def start_sshd(self, host: TestHost) -> None:
        """Start (or restart) the host's sshd; sshd daemonises and writes its PidFile."""
        host.sshd_pid_file.unlink(missing_ok=True)
        subprocess.run(host.exec_argv(SSHD, "-f", str(host.sshd_config)), check=True, capture_output=True, timeout=30)
        # sshd creates the PidFile and then writes it: wait for the number, not for the file
        deadline = time.monotonic() + 10
        while True:
            text = host.sshd_pid_file.read_text() if host.sshd_pid_file.exists() else ""
            if text.split():
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd of {host.netns} wrote no pid to {host.sshd_pid_file} within 10 s")
            time.sleep(0.05)
        host.sshd_pid = int(text.split()[0])

    def stop_sshd(self, host: TestHost) -> None:
        """Take the host off SSH: its listening sshd (pid from the PidFile) and every sshd
        session process inside its namespace (children of that listener), so open
        connections (ansible's ControlPersist masters) drop as well."""
        if host.sshd_pid is None:
            return
        r = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
        victims = {host.sshd_pid}
        for pid in (int(p) for p in r.stdout.split()):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() in ("sshd", "sshd-session"):
                    victims.add(pid)
            except OSError:
                pass
        for pid in victims:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while any(Path(f"/proc/{p}").exists() for p in victims) and time.monotonic() < deadline:
            time.sleep(0.05)
        host.sshd_pid = None

    def _wait_ssh(self, host: TestHost, timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection((host.address, 22), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host.name} ({host.address}) not answering")
            time.sleep(0.1)

    def ssh_argv(self, host: TestHost, *command: str) -> list[str]:
        return [
            "ssh", "-i", str(self.client_key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"{self.user}@{host.address}", *command,
        ]  # fmt: skip

    @staticmethod
    def _kill_leftovers(netns: str) -> None:
        """Safety net: whatever still runs inside a namespace created here was started by this test."""
        r = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        for pid in (int(p) for p in r.stdout.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Stop the sshd processes started here and delete the namespaces and links created here."""
        for h in self.hosts:
            self.stop_sshd(h)
        for netns in self._namespaces:
            self._kill_leftovers(netns)
        for netns in self._namespaces:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._namespaces.clear()
        self._links.clear()
        (REGISTRY / self.tag).unlink(missing_ok=True)


# Which test run owns which lab: a run killed before its teardown (CI's time limit, a SIGKILL) leaves
# its namespaces and bridge behind, and the next lab's addresses (10.77.0.x) would then route into the
# dead one's namespaces, whose sshd is gone. Each lab records its owner's pid here.
REGISTRY = Path("/run/tilepd-test-labs")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc/PID/stat field 22): a pid reused later differs."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _claim(tag: str) -> None:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    (REGISTRY / tag).write_text(f"{os.getpid()} {_start_time(os.getpid())}")


def _owner(tag: str) -> tuple[int, str] | None:
    try:
        pid, started = (REGISTRY / tag).read_text().split()
        return int(pid), started
    except (OSError, ValueError):
        return None  # no record: a lab from a run that is gone (or from before the registry existed)


def remove_stale_labs(prefix: str = "tpd", extra_tags: set[str] | None = None,
                      cleanup: Callable[[str], None] | None = None) -> list[str]:
    """Delete the namespaces, links and processes of labs (named with `prefix`) whose test run is gone;
    refuse to share the addresses with a lab whose run is still alive. `extra_tags`: tags of that kind
    found elsewhere (a cgroup); `cleanup(tag)` runs after a stale lab's processes are killed. Returns
    the tags removed."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    namespaces = [line.split()[0] for line in listed.splitlines() if line.split()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    netns_name = re.compile(rf"^{prefix}-([0-9a-f]{{5}})-host\d+$")
    tags = {m.group(1) for ns in namespaces if (m := netns_name.match(ns))}
    tags |= set(re.findall(rf"\d+: {prefix}br([0-9a-f]{{5}})[:@]", links))
    tags |= extra_tags or set()
    removed = []
    for tag in sorted(tags):
        owner = _owner(tag)
        if owner is not None and owner[0] == os.getpid():
            continue  # this process's own lab
        if owner is not None and _start_time(owner[0]) == owner[1]:
            raise RuntimeError(f"another test run (pid {owner[0]}) holds the SSH test lab {tag} (namespaces {prefix}-{tag}-*); "
                               "run one test session with SSH hosts at a time")
        for netns in namespaces:
            if netns.startswith(f"{prefix}-{tag}-"):
                LabNetwork._kill_leftovers(netns)
        if cleanup is not None:
            cleanup(tag)
        for netns in namespaces:
            if netns.startswith(f"{prefix}-{tag}-"):
                subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        for name in re.findall(rf"\d+: ({prefix}(?:br)?{tag}[a-z0-9]*)[:@]", links):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        (REGISTRY / tag).unlink(missing_ok=True)
        removed.append(tag)
    return removed
