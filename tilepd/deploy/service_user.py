"""What a systemd unit's user needs on its host, and whether it has it: `python -m tilepd.deploy.service_user check`.

In systemd mode every unit runs as `deployment.service_user` (tilepd.plan.systemd), not as the SSH user who wrote
its files. That user must run the interpreter, read the base dir, configs and model, reach (traverse to) its
secrets' paths (its unit shows it there the copies `up` writes for it), and write its data dir. The playbooks
(roles/service_user) create the user and the data dir, then run this check as root before any service starts: a
forked child takes the user's
uid, gid and groups and asks the kernel (`os.access`: modes, ACLs and read-only mounts as the kernel applies them),
so a path the user cannot use is named with the folder or file that blocks it, instead of a unit failing later
with EACCES in its journal.

Manifest on stdin: {"user": NAME, "needs": [{"path", "need": "run" | "read" | "reach" | "write", "why"}]}. A path
that does not exist yet (a model the tiny-model or convert step writes later) needs only its existing folders to be
enterable. Prints one JSON line: {"changed": false, "failed", "user", "problems": [...], "msg"}.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import stat
import subprocess
import sys
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tilepd.plan.model import HostPlan
from tilepd.plan.systemd import data_dir, secret_paths, service_paths

Need = Literal["run", "read", "reach", "write"]
# a user that does not exist yet (`up --check` before the playbook created it) is checked as one with no group the
# files could name: as `nobody`, whose access is the "others" bits
STAND_IN = "nobody"
_SMOKE = "import tilepd"  # the interpreter starts and finds its site-packages as the user
_DENIED = re.compile(r"Permission denied: '([^']+)'")


class Access(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    need: Need
    why: str


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: str
    needs: list[Access]


def access_needs(host: HostPlan) -> list[Access]:
    """What the service user must be able to do on this host for each daemon it runs (the units the playbooks install)."""
    found: dict[tuple[str, str], list[str]] = {}

    def add(path: str, need: Need, why: str) -> None:
        found.setdefault((path, need), []).append(why)

    for svc in host.services:
        if svc.kind != "daemon":
            continue
        data = data_dir(svc.cwd)
        secrets = set(secret_paths(svc))
        add(data, "write", f"{svc.name} data dir")
        for path, where in service_paths(svc):
            if path in secrets:
                add(path, "reach", f"{svc.name} {where}, a secret shown from its copy")
            elif where == "interpreter":
                add(path, "run", f"{svc.name} interpreter")
            elif path != data and not path.startswith(data + "/"):
                add(path, "read", f"{svc.name} {where}")
    return [Access(path=p, need=n, why=", ".join(dict.fromkeys(whys))) for (p, n), whys in found.items()]  # type: ignore[arg-type]


# --- the check (as the user, in a forked child) --------------------------------------------------------------


def _blocker(path: str, need: Need) -> str | None:
    """The first component of `path` this process cannot use for `need` (a folder it cannot enter, or the path
    itself), None when it can. A missing component ends the walk: what is under it does not exist yet."""
    parts = PurePosixPath(os.path.normpath(path)).parts
    current = PurePosixPath(parts[0])
    for part in parts[1:-1]:
        current = current / part
        if not os.path.lexists(current):
            return None
        if not os.access(current, os.X_OK):
            return str(current)
    if need == "reach" or not os.path.lexists(path):
        return None
    mode = {"run": os.X_OK, "read": os.R_OK, "write": os.W_OK | os.X_OK}[need]
    if need == "read" and os.path.isdir(path):
        mode |= os.X_OK
    return None if os.access(path, mode) else path


def _why_blocked(path: str, real: str, need: Need) -> str | None:
    """The component that blocks `path`; through a symlink, the one on its resolved path, which is the one to fix."""
    blocked = _blocker(path, need)
    if blocked is None or real == path:
        return blocked
    return _blocker(real, need) or blocked


def _smoke(python: str) -> str | None:
    """Start the interpreter as this process's user and import tilepd; the error's last line when it cannot."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "PYTHONPATH")}
    try:
        r = subprocess.run([python, "-c", _SMOKE], capture_output=True, text=True, timeout=120, env=env, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if r.returncode == 0:
        return None
    lines = r.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {r.returncode}"


def _check_as_user(needs: list[Access], reals: list[str]) -> list[dict[str, Any]]:
    """Each need this process's user cannot meet: {index, blocker} or {index, error} (a failed start of the interpreter)."""
    out: list[dict[str, Any]] = []
    smoked: set[str] = set()
    for i, (need, real) in enumerate(zip(needs, reals)):
        blocked = _why_blocked(need.path, real, need.need)
        if blocked is not None:
            out.append({"index": i, "blocker": blocked})
        elif need.need == "run" and need.path not in smoked:
            smoked.add(need.path)
            error = _smoke(need.path)
            if error is not None:
                denied = _DENIED.search(error)
                inner = _blocker(denied.group(1), "read") if denied else None
                out.append({"index": i, "error": error, **({"blocker": inner} if inner else {})})
    return out


def _as_user(uid: int, gid: int, groups: list[int], needs: list[Access], reals: list[str]) -> list[dict[str, Any]]:
    """Run the check in a child that has dropped to uid/gid/groups; its findings come back through a pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 0
        try:
            os.close(read_fd)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            payload = json.dumps({"found": _check_as_user(needs, reals)})
        except BaseException as exc:  # noqa: BLE001 - anything the child hits goes back as the answer
            payload, code = json.dumps({"error": f"{type(exc).__name__}: {exc}"}), 1
        with os.fdopen(write_fd, "w") as f:
            f.write(payload)
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        text = f.read()
    os.waitpid(pid, 0)
    answer = json.loads(text or '{"error": "the check as the user ended without an answer"}')
    if "error" in answer:
        raise RuntimeError(f"checking as uid {uid}: {answer['error']}")
    return list(answer["found"])


def _describe(path: str) -> str:
    """`folder /x (mode 0700, owner root:root)`: what the operator has to change."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} ({exc.strerror})"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    kind = "folder" if stat.S_ISDIR(st.st_mode) else "file"
    return f"{kind} {path} (mode {stat.S_IMODE(st.st_mode):04o}, owner {owner}:{group})"


_VERB = {"run": "run", "read": "read", "reach": "reach", "write": "write to"}


def problems(user: str, needs: list[Access], found: list[dict[str, Any]]) -> list[str]:
    """One line per blocking file or folder (what the operator fixes), naming every path it blocks and why each is
    needed; then a line per interpreter that would not start for another reason."""
    by_blocker: dict[tuple[str, str], list[str]] = {}
    other: list[str] = []
    for f in found:
        need = needs[f["index"]]
        blocker = f.get("blocker")
        if blocker is None:
            other.append(f"service user {user} cannot run {need.path} ({need.why}): {f['error']}")
            continue
        action = "enter" if blocker != need.path else _VERB[need.need]
        by_blocker.setdefault((blocker, action), []).append(f"{need.path} ({need.why}{': ' + f['error'] if 'error' in f else ''})")
    lines = [f"service user {user} may not {action} {_describe(blocker)}, so it cannot use {'; '.join(paths)}; give it access (a group "
             f"it is in, or others' bits) or move the path" for (blocker, action), paths in by_blocker.items()]
    return lines + other


def _stand_in() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(STAND_IN)
    except KeyError:  # no `nobody` in this passwd: its usual ids
        return pwd.struct_passwd(("", "x", 65534, 65534, "", "/", ""))


def check(manifest: Manifest, *, check_mode: bool = False) -> dict[str, Any]:
    """Check every need as the service user (root forks a child that becomes it); the problems, each naming a path."""
    note = ""
    try:
        pw = pwd.getpwnam(manifest.user)
    except KeyError:
        if not check_mode:
            return {"changed": False, "failed": True, "user": manifest.user, "problems": [],
                    "msg": f"service user {manifest.user} does not exist on this host (the playbook creates it before this check)"}
        pw = _stand_in()
        note = f" (checked as {STAND_IN}: {manifest.user} does not exist yet, `up` creates it)"
    reals = [os.path.realpath(n.path) for n in manifest.needs]
    if os.geteuid() == pw.pw_uid:
        found = _check_as_user(manifest.needs, reals)
    elif os.geteuid() == 0:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid) if pw.pw_name else [pw.pw_gid]
        found = _as_user(pw.pw_uid, pw.pw_gid, groups, manifest.needs, reals)
    else:
        return {"changed": False, "failed": True, "user": manifest.user, "problems": [],
                "msg": f"checking what service user {manifest.user} may use needs root (become) or that user; this is uid {os.geteuid()}"}
    lines = problems(manifest.user, manifest.needs, found)
    msg = " | ".join(lines) + note if lines else f"service user {manifest.user} can use all {len(manifest.needs)} paths{note}"
    return {"changed": False, "failed": bool(lines), "user": manifest.user, "problems": lines, "msg": msg}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "check":
        print(json.dumps({"failed": True, "changed": False, "msg": "usage: python -m tilepd.deploy.service_user check [--check] < manifest.json"}))
        return 2
    try:
        result = check(Manifest.model_validate_json(sys.stdin.read()), check_mode="--check" in args[1:])
    except (ValueError, OSError, RuntimeError) as exc:
        result = {"failed": True, "changed": False, "msg": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
