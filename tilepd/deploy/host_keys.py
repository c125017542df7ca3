"""SSH host keys of a deployment's hosts: trust on first use, a changed key refused.

Ansible's ssh (StrictHostKeyChecking=accept-new, tilepd.deploy.runner) and tilepd's own paramiko
connections (status, logs, doctor, drain: tilepd.deploy.remote) share one known_hosts file per
deployment, under its state dir. The first contact records a host's key; a later, different key
is refused before anything (the deployment secret included) is sent, with a message naming the host,
the file and the command that re-trusts it once the operator has checked the new key.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
from pathlib import Path
from typing import Any

# what OpenSSH prints when a recorded key differs (accept-new refuses it like `yes` does)
_CHANGED = re.compile(r"REMOTE HOST IDENTIFICATION HAS CHANGED|Host key verification failed", re.I)


def entry_name(address: str, port: int) -> str:
    """The host's name in known_hosts, as OpenSSH and paramiko write it."""
    return address if port == 22 else f"[{address}]:{port}"


def retrust_command(known_hosts: Path, address: str, port: int) -> str:
    """The command that forgets the recorded key (the next contact records the new one)."""
    return shlex.join(["ssh-keygen", "-f", str(known_hosts), "-R", entry_name(address, port)])


def changed_key_message(host: str, known_hosts: Path, address: str, port: int) -> str:
    return (f"{host}: its SSH host key differs from the one recorded at first contact in {known_hosts}; refused (nothing was "
            f"sent). If the host was reinstalled or its key rotated on purpose, check the new key (ssh-keyscan -p {port} {address}) "
            f"and re-trust it: {retrust_command(known_hosts, address, port)}")


def explain_ssh_failure(message: str, host: str, known_hosts: Path | None, address: str | None = None, port: int = 22) -> str:
    """An Ansible unreachable message, rewritten when ssh refused a changed host key."""
    if known_hosts is None or not _CHANGED.search(message):
        return message
    return changed_key_message(host, known_hosts, address or host, port)


def ensure_file(known_hosts: Path) -> None:
    """Create the deployment's known_hosts (0600, its folder 0700) so that both clients record into it."""
    known_hosts.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(known_hosts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.close(fd)


def record(known_hosts: Path, name: str, key: Any) -> None:
    """Append a host's key (paramiko PKey) under a lock: parallel first contacts never overwrite each other."""
    from paramiko.hostkeys import HostKeyEntry

    line = HostKeyEntry([name], key).to_line()
    ensure_file(known_hosts)
    with open(known_hosts, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(line)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fingerprint(key: Any) -> str:
    """OpenSSH's form: SHA256:<base64, unpadded>."""
    import base64
    import hashlib

    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def inventory_endpoints(inventory: Path) -> dict[str, tuple[str, int]]:
    """{inventory host: (address, ssh port)} of the ssh hosts of a rendered inventory.yml."""
    from tilepd.plan.ansible_yaml import load_ansible_yaml

    try:
        hosts = (load_ansible_yaml(inventory.read_text()) or {})["all"]["hosts"]
    except (OSError, KeyError, TypeError, ValueError):
        return {}
    return {name: (str(h.get("ansible_host", name)), int(h.get("ansible_port", 22))) for name, h in hosts.items()
            if isinstance(h, dict) and h.get("ansible_connection") == "ssh"}
