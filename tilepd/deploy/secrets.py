"""Hand secrets to the playbook at run time without writing them on the operator's machine.

ansible-runner records the whole environment of ansible-playbook in
`runner/artifacts/<id>/command`, and host_vars live in the render folder, so neither may
carry a secret. Instead `tilepd up` holds the values in memory and serves them on a
Unix socket in a fresh 0700 directory for the length of the run; the playbook's
`tilepd_secret` lookup (playbooks/lookup_plugins) asks for one by name, on the
controller, inside tasks marked `no_log`. Only the socket's path is in the environment.

Names served: `deployment` (the operator's `$TILEPD_DEPLOYMENT_SECRET`, "" when unset),
`deployment_new` (a fresh secret generated for this run, used when no host holds one yet),
`env:NAME` (the operator's variable NAME, for the router's API key).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tilepd.auth import new_secret
from tilepd.plan import Plan
from tilepd.runbooks import see

SOCKET_ENV = "TILEPD_SECRETS_SOCKET"
_MAX_NAME = 256


class SecretsError(ValueError):
    """A secret the deployment needs is not available (names the variable and what needs it)."""


def values_for(plan: Plan, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values this plan's secret files need, from the operator's environment (raises if one is missing)."""
    env = os.environ if environ is None else environ
    values: dict[str, str] = {}
    for host in plan.hosts:
        for s in host.secrets:
            if s.name == "deployment":
                values["deployment"] = env.get(s.source_env, "").strip()
                values.setdefault("deployment_new", new_secret())
            else:
                value = env.get(s.source_env, "").strip()
                if not value:
                    raise SecretsError(f"router.api_key.env names {s.source_env}, which is not set (or empty) in the environment of "
                                       f"`tilepd up`; export it (the key is written only to {s.path} on {host.name}, mode 0600)"
                                       + see("RB-api-key-rotation"))
                values[f"env:{s.source_env}"] = value
    return values


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):  # not Linux: the 0700 directory is the only gate
        return None
    return struct.unpack("3i", creds)[1]


@contextmanager
def serve(values: Mapping[str, str]) -> Iterator[Path]:
    """Serve `values` on a private Unix socket while the block runs; yields the socket path."""
    folder = Path(tempfile.mkdtemp(prefix="tilepd-secrets-"))  # 0700, like every mkdtemp
    path = folder / "s"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            uid = _peer_uid(conn)
            if uid is not None and uid != os.getuid():
                conn.sendall(json.dumps({"error": f"uid {uid} may not read this run's secrets"}).encode())
                return
            name = conn.recv(_MAX_NAME).decode(errors="replace").strip()
            reply = {"value": values[name]} if name in values else {"error": f"no secret named {name!r} in this run"}
            conn.sendall(json.dumps(reply).encode())

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                answer(conn)
            except OSError:
                pass

    thread = threading.Thread(target=loop, name="tilepd-secrets", daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        try:  # wakes the blocked accept() (close alone does not on Linux)
            listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        listener.close()
        thread.join(timeout=5)
        shutil.rmtree(folder, ignore_errors=True)


def fetch(name: str, socket_path: str | None = None) -> str:
    """Ask the running `tilepd up` for one secret (the playbook's lookup plugin calls this)."""
    where = socket_path or os.environ.get(SOCKET_ENV)
    if not where:
        raise SecretsError(f"{SOCKET_ENV} is not set: secrets are served only while `tilepd up` runs the playbook")
    data = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(where)
            s.sendall(name.encode() + b"\n")
            while chunk := s.recv(65536):
                data += chunk
    except OSError as exc:
        raise SecretsError(f"cannot reach tilepd up's secret socket {where}: {exc}") from exc
    try:
        reply = json.loads(data)
    except ValueError as exc:
        raise SecretsError(f"secret socket {where} answered {len(data)} bytes that are not JSON") from exc
    if "error" in reply:
        raise SecretsError(str(reply["error"]))
    return str(reply["value"])
