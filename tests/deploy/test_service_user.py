"""`python -m tilepd.deploy.service_user check`: what a systemd unit's user may use, asked of the kernel as that user.

Real processes: the check runs as root (as the playbook's become gives it) and forks a child that takes `nobody`'s
uid and groups; the paths are real folders and files with the modes that block or allow it. What the service user
needs per daemon comes from a real plan.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import topo
from tilepd.deploy.service_user import access_needs
from tilepd.plan import build_plan
from tilepd.topology import load_topology

USER = "nobody"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="checking as another user needs root (the playbook's become)")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every user may enter (pytest's own tmp dirs are mode 0700: nobody could enter them)."""
    d = Path(tempfile.mkdtemp(prefix="tilepd-su-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _check(needs: list[dict[str, str]], *extra: str, user: str = USER) -> tuple[int, dict]:
    manifest = json.dumps({"user": user, "needs": needs})
    r = subprocess.run([sys.executable, "-m", "tilepd.deploy.service_user", "check", *extra], input=manifest, capture_output=True, text=True,
                       timeout=120)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_each_blocking_folder_or_file_is_named_once_with_what_it_blocks(open_dir: Path) -> None:
    private = open_dir / "private"
    private.mkdir(mode=0o700)
    (private / "model").mkdir()
    secret_only = open_dir / "secret-for-root"
    secret_only.write_text("x\n")
    secret_only.chmod(0o600)
    root_dir = open_dir / "data-of-root"
    root_dir.mkdir(mode=0o755)
    nobody = pwd.getpwnam(USER)
    theirs = open_dir / "data"
    theirs.mkdir(mode=0o750)
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    (open_dir / "link").symlink_to(private / "model")
    needs = [
        {"path": str(private / "model"), "need": "read", "why": "decode-d0 weights_dir"},
        {"path": str(private / "not-yet" / "tokenizer"), "need": "read", "why": "router tokenizer_dir"},
        {"path": str(open_dir / "link"), "need": "read", "why": "prefill-p0 argv"},
        {"path": str(secret_only), "need": "read", "why": "router config"},
        {"path": str(secret_only), "need": "reach", "why": "router secret_file, a secret shown from its copy"},
        {"path": str(root_dir), "need": "write", "why": "router data dir"},
        {"path": str(theirs), "need": "write", "why": "decode-d0 data dir"},
        {"path": str(open_dir / "later" / "weights"), "need": "read", "why": "decode-d0 weights_dir, converted later"},
        {"path": _script(open_dir / "python", "exit 0"), "need": "run", "why": "decode-d0 interpreter"},
    ]
    rc, out = _check(needs)
    assert rc == 1 and out["failed"] is True, out
    lines = out["problems"]
    assert len(lines) == 3, lines
    folder = next(line for line in lines if f"folder {private} (mode 0700, owner root:root)" in line)
    # the folder blocks three needs (the symlink's through its target), each named with why it is needed
    assert f"may not enter folder {private}" in folder
    for named in (f"{private}/model (decode-d0 weights_dir)", f"{private}/not-yet/tokenizer (router tokenizer_dir)", f"{open_dir}/link (prefill-p0 argv)"):
        assert named in folder, folder
    assert any(f"may not read file {secret_only} (mode 0600, owner root:root)" in line and "(router config)" in line for line in lines), lines
    assert any(f"may not write to folder {root_dir} (mode 0755, owner root:root)" in line for line in lines), lines
    # allowed: reaching a secret (systemd hands it over), writing its own data dir, a path not made yet, the interpreter
    assert "secret_file" not in out["msg"] and f"{theirs} (" not in out["msg"] and "later" not in out["msg"], out["msg"]
    assert "interpreter" not in out["msg"], out["msg"]


def test_an_interpreter_that_cannot_start_as_the_user_names_the_file(open_dir: Path) -> None:
    """The smoke start (`import tilepd` as the user) fails: the PermissionError's file is found and its blocker named."""
    hidden = open_dir / "site"
    hidden.mkdir(mode=0o700)
    python = _script(open_dir / "python", f"echo \"PermissionError: [Errno 13] Permission denied: '{hidden}/tilepd/__init__.py'\" >&2; exit 1")
    rc, out = _check([{"path": python, "need": "run", "why": "router interpreter"}])
    assert rc == 1, out
    assert f"may not enter folder {hidden} (mode 0700" in out["msg"] and "Permission denied" in out["msg"], out["msg"]
    broken = _script(open_dir / "python2", "echo 'ModuleNotFoundError: No module named tilepd' >&2; exit 1")
    rc, out = _check([{"path": broken, "need": "run", "why": "router interpreter"}])
    assert rc == 1 and out["msg"] == f"service user {USER} cannot run {broken} (router interpreter): ModuleNotFoundError: No module named tilepd", out
    rc, out = _check([{"path": _script(open_dir / "python3", "exit 0"), "need": "run", "why": "router interpreter"}])
    assert (rc, out["failed"]) == (0, False), out


def test_a_user_not_created_yet_is_a_failure_except_in_check_mode(open_dir: Path) -> None:
    missing = "tilepd-no-such-user"
    with pytest.raises(KeyError):
        pwd.getpwnam(missing)
    private = open_dir / "private"
    private.mkdir(mode=0o700)
    needs = [{"path": str(private / "x"), "need": "read", "why": "router config"}]
    rc, out = _check(needs, user=missing)
    assert rc == 1 and "does not exist on this host" in out["msg"], out
    rc, out = _check(needs, "--check", user=missing)  # `up --check`: as nobody (others' bits), said so
    assert rc == 1 and f"folder {private}" in out["msg"] and f"checked as nobody: {missing} does not exist yet" in out["msg"], out
    rc, out = _check([{"path": str(open_dir), "need": "read", "why": "router working directory"}], "--check", user=missing)
    assert rc == 0 and out["failed"] is False, out


def test_the_needs_of_each_daemon_come_from_the_plan(tmp_path: Path) -> None:
    data = topo.lab_topology(tmp_path, tmp_path / "key", name="t-su")
    data["deployment"]["services"] = "systemd"
    plan = build_plan(load_topology(topo.write(data, tmp_path / "t.yaml")))
    decode = plan.host("10.77.0.11")
    needs = {(a.path, a.need): a.why for a in access_needs(decode)}
    base = f"{tmp_path}/hosts/d0"
    assert needs[(f"{base}/data", "write")] == "decode-d0 data dir"
    assert needs[(f"{base}/secrets/deployment", "reach")] == "decode-d0 secret_file, a secret shown from its copy"
    assert needs[(plan.service("decode-d0").python, "run")] == "decode-d0 interpreter"
    assert needs[(f"{tmp_path}/models/tiny-llama-tilepd", "read")] == "decode-d0 weights_dir"
    assert needs[(f"{base}/config/decode-d0.json", "read")] == "decode-d0 argv"
    # the drain file lives in the data dir (systemd mode): covered by its write need, not a read of its own
    assert plan.service("decode-d0").config["drain_file"] == f"{base}/data/decode-d0.drained"
    assert not any(p.startswith(f"{base}/data/") for p, _ in needs), needs
    assert not any(n == "read" and p.endswith("/secrets/deployment") for p, n in needs)  # systemd reads secrets
    assert all(a.path for a in access_needs(plan.host("10.77.0.12")) if a.why.startswith("prefill-p0"))
    assert (f"{tmp_path}/models/tiny-llama", "read") in {(a.path, a.need) for a in access_needs(plan.host("10.77.0.13"))}  # tokenizer
