"""SSH host keys, trust on first use, on the network-namespace hosts (each its own sshd): the first contact
records the key in the deployment's known_hosts, a changed key is refused by Ansible's ssh (`up`) and by
paramiko (`doctor`, `status`) with the host and the re-trust command named, and that command restores trust."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy import topo
from tests.deploy.cli import tilepd
from tests.deploy.netns import LabNetwork

pytestmark = pytest.mark.slow

ROUTER = "10.77.0.13"


def _doctor_key(home: Path, file: Path) -> dict:
    r = tilepd(home, "doctor", str(file), "--host", ROUTER, "--no-live", "--json")
    findings = r.json()["findings"] if isinstance(r.json(), dict) else r.json()
    return next(f for f in findings if f["check"] == "ssh-host-key")


def _new_host_key(net: LabNetwork, host_key: Path) -> None:
    """The router host 'reinstalled': a new ed25519 key for its sshd, which restarts (open sessions drop)."""
    host_key.unlink()
    host_key.with_suffix(".pub").unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    router = next(h for h in net.hosts if h.address == ROUTER)
    net.stop_sshd(router)
    net.start_sshd(router)


def test_a_changed_host_key_is_refused_until_re_trusted(lab_network: LabNetwork, tmp_path: Path) -> None:
    home = tmp_path / "home"
    file = topo.write(topo.lab_topology(tmp_path, lab_network.client_key, name="t-hostkey"), tmp_path / "lab.yaml")
    router = next(h for h in lab_network.hosts if h.address == ROUTER)
    host_key = router.sshd_config.parent / "host_key"
    saved = tmp_path / "saved_host_key"
    shutil.copy(host_key, saved)
    shutil.copy(host_key.with_suffix(".pub"), saved.with_suffix(".pub"))
    try:
        first = tilepd(home, "up", str(file), "-y", "--check", "--only", "router")
        assert first.rc == 0, first
        key = _doctor_key(home, file)
        assert key["verdict"] == "ok" and "matches the one recorded" in key["evidence"], key  # ansible's ssh recorded it

        _new_host_key(lab_network, host_key)
        refused = tilepd(home, "up", str(file), "-y", "--check", "--only", "router")
        assert refused.rc == 5, refused
        assert f"unreachable host {ROUTER}" in refused.stderr and "differs from the one recorded at first contact" in refused.stderr, refused
        command = re.search(r"re-trust it: (ssh-keygen -f \S+ -R \S+)", refused.stderr)
        assert command is not None, refused
        assert command.group(1).endswith(f"-R {ROUTER}")
        changed = _doctor_key(home, file)
        assert changed["verdict"] == "fail" and changed["evidence"].startswith("CHANGED") and command.group(1) in changed["fix"], changed
        status = tilepd(home, "status", str(file), "--json")
        router_row = next(s for s in status.json()["services"] if s["role"] == "router")
        assert router_row["run"] == "unreachable", router_row

        retrust = subprocess.run(shlex.split(command.group(1)), capture_output=True, text=True, timeout=30)
        assert retrust.returncode == 0, retrust.stderr
        again = tilepd(home, "up", str(file), "-y", "--check", "--only", "router")
        assert again.rc == 0, again
        assert _doctor_key(home, file)["verdict"] == "ok"
    finally:
        shutil.copy(saved, host_key)
        shutil.copy(saved.with_suffix(".pub"), host_key.with_suffix(".pub"))
        lab_network.stop_sshd(router)
        lab_network.start_sshd(router)
