"""Process-mode service supervisor: start, stop, check and health-gate one service.

Hosts without systemd (containers, dev boxes, the test namespaces) run each service
detached in its own session with a pidfile and a log file. Ansible calls this module
with a `command` task (`python -m tilepd.deploy.proc start --spec FILE`) and reads the
one JSON line it prints, so idempotence ("already running with the same config hash")
is decided here in Python rather than in shell snippets.

Beside the pidfile a state file records the pid, its kernel start time (so a reused
pid is never mistaken for ours), the process group, the config hash the service
was started with (drift detection in `tilepd status`) and a fingerprint of the secret
files it read at start (a rotated secret restarts it).

Ownership: the supervisor signals only what it started. The state also records the kernel's boot id
and a random token the service gets in its environment (TILEPD_OWNER, inherited by every child); a
process is ours only on the same boot, with the recorded start time, and with the token in its
/proc/PID/environ. Anything else (a state file left from before a reboot or a container restart, a pid
or group id that now belongs to someone else, an environ we may not read) reads as "not running", is
never signalled, and the reason goes into the service's log and the verb's JSON (`not_ours`). A state
file from a tilepd before this check (no boot id, no token) is ours only while its main process runs
with the recorded pid and start time (the check that tilepd made, so an upgrade can still stop what it
started; the next start writes the new fields); its orphans cannot be told from strangers and are left alone.

Every service is the leader of its own process group, and every verb acts on the group:
children re-parented to init when the main process died (vLLM's EngineCore and workers
after a SIGKILL of the API server, still holding their ports) keep the group id, so `stop`
ends them and `start` ends them before starting the service again. The kernel does not
hand out a pid again while a group of that id has members, so the recorded group id
cannot name someone else's processes.

The state also records the installed versions of the distributions the service runs on (`packages`:
vllm for prefill, torch for decode nodes), read with the service's own interpreter before it starts: an
upgrade of one (`pip install -U vllm` on the host) restarts the service on the next `up`, like a changed
config does.

Rolling restart: a running decode node that must restart (config hash, secret, tilepd or package
version changed, or `--force`) is drained first (tilepd.deploy.drain: its request finishes,
new ones go to other nodes), restarted, and gated on health here, in the same call, so the
playbook's loop (and its `throttle: 1` across hosts) restarts decode nodes one at a time and
never takes a second one away before the first serves again. The node keeps its drained state
across the restart (its drain_file), so it comes back healthy but out of rotation; the canary
(tilepd.deploy.canary: one request through the prefill and this node) runs, and only then is it
undrained. A failed canary leaves it drained and fails the start. A node an operator had drained
before `up` stays drained.

A running router behind a balancer that must restart is drained at the balancer the same way (tilepd.deploy.balancer:
its /health answers 503 draining, the balancer takes it out, its requests in flight end, at most the balancer's
`drain_timeout_s`), restarted, gated on health, and this call returns once the balancer shows it UP again; `throttle:
1` in the playbook restarts the routers one at a time, so the balancer always has one to send requests to.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tilepd import __version__
from tilepd.deploy import logpipe
from tilepd.deploy.balancer import BalancerError, BalancerSpec, drain_router, wait_idle, wait_state
from tilepd.deploy.canary import CanarySpec, run_canary
from tilepd.runbooks import see

# Variables a service inherits from the supervisor's environment; everything else
# comes from the spec, so process mode sees what a systemd EnvironmentFile would give.
_INHERITED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR")

# rolling restart of a decode node: the longest wait for its request to finish before it is restarted anyway
# (the router then moves that request to another node); and how long a drained or restarted node is left before
# the next step, so that the router's health check (every health_interval_s, 1 s by default) has seen the change
RESTART_DRAIN_TIMEOUT_S = 120.0
ROTATION_GRACE_S = 3.0
# how long the balancer may take to mark a draining router out (or a restarted one UP) beyond its checks' own pace
BALANCER_MARK_TIMEOUT_S = 15.0

# the ownership marker every process a start spawns carries in its environment (value: the state file's owner_token)
OWNER_ENV = "TILEPD_OWNER"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# an empty /proc/PID/environ is a process in the middle of an exec (see _carries_token): read again this often, this long
ENVIRON_RETRY_S = 0.015
ENVIRON_EXEC_WAIT_S = 2.0


class ServiceSpec(BaseModel):
    """One service as the supervisor runs it (written by the deploy step next to the pidfile)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    role: str
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: Path
    log_file: Path
    pid_file: Path
    config_hash: str
    health_url: str | None = None
    health_timeout_s: float = Field(default=180.0, gt=0)
    stop_timeout_s: float = Field(default=20.0, gt=0)
    # files the service reads secrets from at start (paths only): their fingerprint is recorded
    secret_files: list[Path] = Field(default_factory=list)
    # distributions the service runs on besides tilepd (prefill: vllm): their installed versions, read with the
    # service's own interpreter, are recorded at start, and an upgrade of one restarts the service on the next `up`
    packages: list[str] = Field(default_factory=list)
    # systemd mode: the unit runs the service; this module only reads its state
    mode: Literal["process", "systemd"] = "process"
    unit: str | None = None
    unit_path: Path | None = None
    # decode nodes: the request a drained restart sends through the prefill and this node before it is undrained
    canary: CanarySpec | None = None
    # routers behind a balancer: where the balancer shows them (a restart drains them there first)
    balancer: BalancerSpec | None = None

    @property
    def state_file(self) -> Path:
        return self.pid_file.with_name(self.pid_file.name.removesuffix(".pid") + ".state.json")


def load_spec(path: Path) -> ServiceSpec:
    return ServiceSpec.model_validate_json(Path(path).read_text())


# --- /proc helpers -------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start_ticks) of a live pid from /proc, None when it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[19])


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group: the service and every child it spawned."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        st = _proc_stat(int(entry.name))
        if st is not None and st[1] == pgid and st[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _read_state(spec: ServiceSpec) -> dict[str, Any] | None:
    try:
        state = json.loads(spec.state_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("pid"), int) else None


def boot_id() -> str:
    """This boot's id: a state file written on another boot names processes that are gone."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _read_environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def _carries_token(pid: int, token: str) -> bool:
    """Whether the process has our ownership marker in its environment (False when environ cannot be read).

    An empty read is not an answer: while a process execs (logpipe execs the service in the pid `start` returns, so
    `wait_healthy` reads it right then) the kernel shows an empty environ between replacing its memory and laying
    out the new stack, and a process of ours always has the marker in it. So an empty read is read again, every
    ENVIRON_RETRY_S, for at most ENVIRON_EXEC_WAIT_S, while the pid still runs with the same start time; a
    non-empty environ without the marker, an unreadable one, and a process that ends or turns zombie meanwhile
    (its memory is gone, its environ stays empty) are not ours at once."""
    marker = f"{OWNER_ENV}={token}".encode()
    deadline, ticks = time.monotonic() + ENVIRON_EXEC_WAIT_S, None
    while True:
        try:
            environ = _read_environ(pid)
        except OSError:
            return False
        if environ:
            return marker in environ.split(b"\0")
        st = _proc_stat(pid)
        if st is None or st[0] in ("Z", "X") or ticks not in (None, st[2]) or time.monotonic() >= deadline:
            return False
        ticks = st[2]
        time.sleep(ENVIRON_RETRY_S)


def not_ours(state: dict[str, Any] | None) -> str | None:
    """Why the state file's main process is not a live process this supervisor started (None: it is)."""
    if not state:
        return "no state file"
    pid = int(state["pid"])
    if state.get("boot_id") and state["boot_id"] != boot_id():
        return f"state file is from another boot ({state['boot_id']}, now {boot_id()})"
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return f"pid {pid} is gone"
    if st[2] != int(state.get("start_ticks") or 0):
        return f"pid {pid} started at tick {st[2]}, not at the recorded {state.get('start_ticks')}: another process"
    token = state.get("owner_token")
    if token:
        return None if _carries_token(pid, str(token)) else f"pid {pid} does not carry {OWNER_ENV} of this service (or its environ is unreadable)"
    return None  # a state file from a tilepd before the marker: pid and start time, the check that tilepd made


def _alive(state: dict[str, Any] | None) -> bool:
    """True when the recorded process still runs and is ours (same boot, pid, kernel start time, ownership marker)."""
    return not_ours(state) is None


def _owned_members(state: dict[str, Any]) -> list[int]:
    """Members of the recorded group that carry this service's ownership marker, on the boot that wrote the state
    ([] for a state file without a marker: its strays cannot be told from a stranger's)."""
    token = state.get("owner_token")
    if not token or state.get("boot_id") != boot_id():
        return []
    pgid = int(state.get("pgid") or state["pid"])
    return [p for p in _group_members(pgid) if _carries_token(p, str(token))] if pgid > 1 else []


def secrets_fingerprint(spec: ServiceSpec) -> str | None:
    """A digest of the secret files' contents (None without any): tells a rotated secret from the one running.

    A SHA-256 of high-entropy secrets reveals nothing about them; the state file holds only this.
    """
    if not spec.secret_files:
        return None
    h = hashlib.sha256(b"tilepd-secrets-fingerprint\0")
    for path in spec.secret_files:
        try:
            h.update(hashlib.sha256(Path(path).read_bytes()).digest())
        except OSError:
            h.update(b"missing")
    return h.hexdigest()[:16]


def _orphans(state: dict[str, Any] | None) -> list[int]:
    """Our processes of the recorded group whose main process is gone (children re-parented to init)."""
    if not state or _alive(state):
        return []
    return _owned_members(state)


def _end_group(pgid: int, stop_timeout_s: float, token: str | None = None) -> tuple[str, list[int]]:
    """SIGTERM the group, SIGKILL what is left after stop_timeout_s; (signal used, pids still alive).

    With a token, each signal goes out only while a member still carries it: a group whose last process of ours
    ended meanwhile is never signalled (its id could be someone else's by then)."""
    def ours() -> bool:
        return token is None or any(_carries_token(p, token) for p in _group_members(pgid))

    signal_used = "SIGTERM"
    if ours():
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_members(pgid) and ours():
        signal_used = "SIGKILL"
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return signal_used, _group_members(pgid)


def _clear(spec: ServiceSpec) -> None:
    for p in (spec.pid_file, spec.state_file):
        p.unlink(missing_ok=True)


def tail(path: Path, n: int = 20) -> list[str]:
    """The last n lines of a log file ([] when it does not exist)."""
    try:
        with open(path, "r", errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except FileNotFoundError:
        return []


def log_tail(spec: ServiceSpec, n: int = 20) -> list[str]:
    """The service's last n log lines: journald's for a systemd unit (its output goes there), else the log file."""
    if spec.mode != "systemd" or not spec.unit:
        return tail(spec.log_file, n)
    try:
        r = subprocess.run(["journalctl", "--no-pager", "-o", "cat", "-u", spec.unit, "-n", str(n)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"<journalctl -u {spec.unit}: {exc}>"]
    return r.stdout.splitlines()[-n:] if r.returncode == 0 else [f"<journalctl -u {spec.unit}: {r.stderr.strip()[-200:]}>"]


# --- verbs ---------------------------------------------------------------------------


def _systemctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120)


def _systemd_state(spec: ServiceSpec) -> dict[str, Any]:
    """Run state of the service's systemd unit; `restarts`: systemd's NRestarts, how often Restart=on-failure
    brought it back since it was last started on purpose (`up`, `systemctl start/restart` reset it)."""
    props: dict[str, str] = {}
    try:
        out = _systemctl("show", "-p", "ActiveState", "-p", "MainPID", "-p", "NRestarts", str(spec.unit)).stdout
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    except (OSError, subprocess.TimeoutExpired):
        pass
    pid = int(props.get("MainPID", "0") or 0)
    restarts = props.get("NRestarts", "")
    return {"running": props.get("ActiveState") in ("active", "activating", "reloading"), "pid": pid or None,
            "state": props.get("ActiveState", ""),
            "restarts": int(restarts) if restarts.isdigit() else None}


_VERSIONS_SCRIPT = """
import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def package_versions(spec: ServiceSpec) -> dict[str, str | None]:
    """The installed versions of `spec.packages` as the service's interpreter (argv[0], its env) sees them; {} when
    the service is not a Python program or the interpreter cannot say (then nothing is compared)."""
    if not spec.packages or "python" not in Path(spec.argv[0]).name:
        return {}
    env = {k: v for k, v in os.environ.items() if k in _INHERITED_ENV}
    env.update(spec.env)
    try:
        r = subprocess.run([spec.argv[0], "-c", _VERSIONS_SCRIPT, *spec.packages], capture_output=True, text=True, timeout=30, env=env)
        out = json.loads(r.stdout) if r.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}
    return {k: v for k, v in out.items() if k in spec.packages} if isinstance(out, dict) else {}


def _versions_changed(state: dict[str, Any] | None, spec: ServiceSpec) -> dict[str, tuple[str | None, str | None]]:
    """{package: (running, installed)} for each package whose installed version differs from the one recorded at start."""
    recorded = (state or {}).get("package_versions") or {}
    if not spec.packages or not recorded:
        return {}  # started before versions were recorded: nothing to compare with
    now = package_versions(spec)
    return {k: (recorded.get(k), now.get(k)) for k in spec.packages if k in now and k in recorded and now[k] != recorded[k]}


def _write_state(spec: ServiceSpec, pid: int, versions: dict[str, str | None] | None = None, token: str | None = None) -> None:
    st = _proc_stat(pid) if pid else None
    state = {
        "pid": pid,
        "pgid": pid,
        "start_ticks": st[2] if st else 0,
        "boot_id": boot_id(),
        "owner_token": token,
        "config_hash": spec.config_hash,
        "secrets_fingerprint": secrets_fingerprint(spec),
        "tilepd_version": __version__,
        "package_versions": versions if versions is not None else package_versions(spec),
        "started_at": time.time(),
        "argv": spec.argv,
        "mode": spec.mode,
    }
    spec.state_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = spec.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, spec.state_file)
    if spec.mode == "process":
        spec.pid_file.write_text(f"{pid}\n")


def status(spec: ServiceSpec) -> dict[str, Any]:
    state = _read_state(spec)
    restarts = None  # process mode: nothing restarts a service but `up`
    if spec.mode == "systemd":
        sd = _systemd_state(spec)
        running, pid, restarts = sd["running"], sd["pid"], sd["restarts"]
    else:
        running = _alive(state)
        pid = int(state["pid"]) if running and state else None
    orphans = _orphans(state) if spec.mode == "process" else []
    stranger = _stranger(spec, state, orphans, note=False) if spec.mode == "process" else {}
    return {
        **stranger,
        "name": spec.name,
        "running": running,
        "pid": pid,
        "restarts": restarts,
        "config_hash": state.get("config_hash") if state else None,
        "hash_matches": bool(state and state.get("config_hash") == spec.config_hash),
        "tilepd_version": state.get("tilepd_version") if state else None,
        "started_at": state.get("started_at") if state else None,
        "log_file": str(spec.log_file),
        # processes of the service's group whose main process died: `up` ends them and starts it again
        "orphans": orphans,
        "changed": False,
    }


def fingerprint_of(spec: ServiceSpec) -> dict[str, Any] | None:
    """The service's deployment fingerprint (tilepd.deploy.fingerprints), the vLLM release the one it runs."""
    from tilepd.deploy.fingerprints import VLLM_ROLES, service_fingerprint

    version = None
    if spec.role in VLLM_ROLES:
        recorded = (_read_state(spec) or {}).get("package_versions") or package_versions(spec)
        version = next((v for k, v in recorded.items() if k.startswith("vllm") and v), None)
    return service_fingerprint(spec.role, spec.argv, version)


def start(spec: ServiceSpec, *, check: bool = False, force: bool = False) -> dict[str, Any]:
    """Start the service unless it already runs with the same config hash, secrets and tilepd version (then
    changed=False; `force` restarts it anyway). A running decode node is drained first and gated on health after.

    A service whose main process died while others of its group live on (orphans) is
    recovered: the group is ended first, so the new one finds its ports free.
    """
    state = _read_state(spec)
    running = _systemd_state(spec)["running"] if spec.mode == "systemd" else _alive(state)
    upgraded = _versions_changed(state, spec) if running else {}
    same = bool(state and state.get("config_hash") == spec.config_hash and state.get("secrets_fingerprint") == secrets_fingerprint(spec)
                and state.get("tilepd_version", __version__) == __version__ and not upgraded)
    if running and same and not force:
        return {**status(spec), "action": "none"}
    why = {"upgraded": {k: {"running": a, "installed": b} for k, (a, b) in upgraded.items()}} if upgraded else {}
    orphans = _orphans(state) if spec.mode == "process" else []
    action = "restart" if running else ("recover" if orphans else "start")
    if check:
        return {**status(spec), "changed": True, "action": action, **why}
    if upgraded:
        _note(spec, "restarting: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in upgraded.items()))
    drained = _drain_for_restart(spec) if running else None
    if spec.mode == "systemd":
        return _rejoin(spec, _start_unit(spec, action), drained)
    recovered: dict[str, Any] = {} if running or orphans else _stranger(spec, state, orphans)
    if running:
        stop(spec)
    elif orphans and state is not None:
        pgid = int(state.get("pgid") or state["pid"])
        signal_used, left = _end_group(pgid, spec.stop_timeout_s, state.get("owner_token"))
        recovered = {"orphans_ended": orphans, "signal": signal_used}
        _note(spec, f"main process {state['pid']} was gone; ended {len(orphans)} orphaned process(es) of group {pgid} with {signal_used}")
        if left:
            return {**status(spec), "changed": True, "failed": True, "action": action,
                    "msg": f"{spec.name}: processes {left} of the dead service's group {pgid} survived SIGKILL; cannot start it again"}
    _clear(spec)
    for d in (spec.log_file.parent, spec.pid_file.parent, spec.cwd):
        d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k in _INHERITED_ENV or k.startswith("LC_")}
    env.update(spec.env)
    token = secrets.token_hex(16)
    env[OWNER_ENV] = token  # every process of this start carries it: what stop and recover check before a signal
    versions = package_versions(spec)  # what the new process will import
    with open(spec.log_file, "ab") as log:
        log.write(f"--- tilepd {__version__}: starting {spec.name} ({spec.config_hash[:19]}) at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            logpipe.wrap(spec.argv, spec.log_file),  # execs argv (same pid) with its output rotated into log_file
            cwd=spec.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own session and process group: survives the SSH session, stops as a group
            close_fds=True,
        )
    _write_state(spec, proc.pid, versions, token)
    return _rejoin(spec, {**status(spec), "changed": True, "action": action, **recovered, **why}, drained)


def _drain_for_restart(spec: ServiceSpec) -> dict[str, Any] | None:
    """Drain a running decode node before its restart (None for other roles): wait until its request finished
    (at most RESTART_DRAIN_TIMEOUT_S), then long enough for the router to have stopped leasing it.

    A node that cannot be drained (no admin API in an older tilepd, a rotated secret it does not know yet, no
    answer) is restarted anyway, as before drain existed: the router moves its request to another node.
    """
    if spec.role == "router":
        return _drain_router_for_restart(spec)
    if spec.role != "decode" or not spec.health_url:
        return None
    from tilepd.deploy.drain import DrainError, drain

    base = spec.health_url.removesuffix("/health")
    t0 = time.monotonic()
    before = _node_status(base)
    try:
        secret = _node_secret(spec)
        r = drain(base, secret, timeout_s=RESTART_DRAIN_TIMEOUT_S, node=spec.name)
    except (DrainError, OSError) as exc:  # OSError: SecretFileError
        _note(spec, f"could not drain before the restart ({exc}); restarting without it")
        return {"drained": False, "error": str(exc)}
    time.sleep(max(0.0, ROTATION_GRACE_S - (time.monotonic() - t0)))
    _note(spec, f"drained before the restart: {'idle' if r.idle else 'still busy'} after {r.waited_s:.1f}s")
    return {"drained": r.idle, "waited_s": r.waited_s, "by_operator": bool(before.get("draining"))}


def _drain_router_for_restart(spec: ServiceSpec) -> dict[str, Any] | None:
    """Take a router behind a balancer out before its restart (None without a balancer): drain it, wait until the
    balancer sends it nothing new, then until its requests end (at most the balancer's drain_timeout_s)."""
    b = spec.balancer
    if b is None or not spec.health_url:
        return None
    base = spec.health_url.removesuffix("/health")
    t0 = time.monotonic()
    try:
        drain_router(base, _node_secret(spec))
        state = wait_state(b, taking_new=False, timeout_s=BALANCER_MARK_TIMEOUT_S + 4 * b.check_interval_s)
        left = wait_idle(base, b.drain_timeout_s)
    except (BalancerError, OSError) as exc:  # OSError: SecretFileError
        _note(spec, f"could not drain at the balancer before the restart ({exc}); restarting without it")
        return {"drained": False, "error": str(exc)}
    waited = time.monotonic() - t0
    _note(spec, f"drained at the balancer ({state}) before the restart: "
                f"{'idle' if left == 0 else f'{left} request(s) still in flight'} after {waited:.1f}s")
    return {"drained": left == 0, "waited_s": round(waited, 3), "in_flight_left": left, "balancer_state": state}


def _rejoin_router(spec: ServiceSpec, result: dict[str, Any], drained: dict[str, Any]) -> dict[str, Any]:
    """After a drained restart: gate on health, then wait until the balancer sends the router requests again."""
    gate = wait_healthy(spec)
    if gate.get("failed"):
        return {**result, "drain": drained, "failed": True, "healthy": False, "msg": gate["msg"], "log_tail": gate.get("log_tail", [])}
    b = spec.balancer
    assert b is not None
    try:
        state = wait_state(b, taking_new=True, timeout_s=BALANCER_MARK_TIMEOUT_S + 4 * b.check_interval_s)
    except BalancerError as exc:
        return {**result, "drain": drained, "failed": True, "healthy": True, "msg": f"{spec.name}: restarted and healthy, but {exc}"}
    _note(spec, f"restarted after a drain; healthy; the balancer shows it {state}")
    return {**result, "drain": drained, "healthy": True, "balancer_state": state}


def _node_status(base: str) -> dict[str, Any]:
    """The node's /status (whether an operator drained it), {} when it does not say."""
    try:
        with urllib.request.urlopen(f"{base}/status", timeout=5) as resp:  # noqa: S310 (URLs come from the plan)
            body = json.loads(resp.read(65536) or b"{}")
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _node_secret(spec: ServiceSpec) -> bytes | None:
    """The deployment secret the running node derives its API key from (its config's secret_file, the spec's first)."""
    from tilepd.deploy.drain import secret_from

    return secret_from(Path(spec.secret_files[0])) if spec.secret_files else None


def _rejoin(spec: ServiceSpec, result: dict[str, Any], drained: dict[str, Any] | None) -> dict[str, Any]:
    """After a drained restart: gate on health, send the canary, undrain, then leave the router time to lease the
    node again. A failed canary leaves the node drained and fails the start."""
    if drained is None or result.get("failed"):
        return result if drained is None else {**result, "drain": drained}
    if spec.role == "router":
        return _rejoin_router(spec, result, drained)
    gate = wait_healthy(spec)
    if gate.get("failed"):
        return {**result, "drain": drained, "failed": True, "healthy": False, "msg": gate["msg"], "log_tail": gate.get("log_tail", [])}
    out: dict[str, Any] = {**result, "drain": drained, "healthy": True}
    base = str(spec.health_url).removesuffix("/health")
    try:
        secret = _node_secret(spec)
    except OSError as exc:  # SecretFileError: the drain above could not have worked either
        _note(spec, f"restarted after a drain; healthy; no canary and no undrain: {exc}")
        return out
    if spec.canary is not None:
        canary = run_canary(spec.canary, base, secret)
        out["canary"] = canary.as_json()
        _note(spec, f"canary {canary.outcome} in {canary.seconds:.1f}s: {canary.reason}")
        if canary.outcome == "failed":
            return {**out, "failed": True, "msg": f"{spec.name}: restarted and healthy, but its canary failed: {canary.reason}; it "
                    f"stays drained (no lease) until `tilepd undrain`" + see("RB-upgrade")}
    if drained.get("by_operator"):
        _note(spec, "restarted after a drain; healthy; drained by an operator before `up`: it stays drained (tilepd undrain)")
        return out
    from tilepd.deploy.drain import DrainError, undrain

    try:
        undrain(base, secret, node=spec.name)
    except DrainError as exc:  # an older node without the admin API starts undrained anyway
        _note(spec, f"could not undrain after the restart ({exc})")
    time.sleep(ROTATION_GRACE_S)
    _note(spec, "restarted after a drain; healthy")
    return out


def _note(spec: ServiceSpec, text: str) -> None:
    """One supervisor line in the service's log (what happened between two runs of it)."""
    spec.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_file, "a") as log:
        log.write(f"--- tilepd {__version__}: {text} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")


def _start_unit(spec: ServiceSpec, action: str) -> dict[str, Any]:
    """systemd mode: enable and (re)start the unit the playbook installed; record the hash it runs with."""
    versions = package_versions(spec)  # what the new process will import
    before = _systemd_state(spec)["pid"]
    # --no-block: a Type=notify unit (the decode node) is "activating" until it sends READY=1, which takes as long as
    # its weights take to load (minutes for a large model, past _systemctl's timeout); the health gate waits for it
    for args in (("enable", str(spec.unit)), ("restart", "--no-block", str(spec.unit))):
        r = _systemctl(*args)
        if r.returncode != 0:
            return {"name": spec.name, "changed": True, "failed": True, "msg": f"systemctl {' '.join(args)}: {r.stderr.strip()}"}
    _write_state(spec, _main_pid_once_started(spec, before), versions)
    return {**status(spec), "changed": True, "action": action}


def stop(spec: ServiceSpec, *, check: bool = False) -> dict[str, Any]:
    """SIGTERM the service's process group, SIGKILL what is left after stop_timeout_s."""
    if spec.mode == "systemd":
        return _stop_unit(spec, check=check)
    state = _read_state(spec)
    orphans = _orphans(state)
    stranger = _stranger(spec, state, orphans)
    if not _alive(state) and not orphans:
        if not check:
            _clear(spec)
        return {"name": spec.name, "changed": False, "running": False, "action": "none", **stranger}
    assert state is not None
    if check:
        return {"name": spec.name, "changed": True, "running": True, "action": "stop", "pid": state["pid"], "orphans": orphans}
    pgid = int(state.get("pgid", state["pid"]))
    signal_used, left = _end_group(pgid, spec.stop_timeout_s, state.get("owner_token"))
    if orphans:
        _note(spec, f"main process {state['pid']} was gone; stop ended {len(orphans)} orphaned process(es) of group {pgid} with {signal_used}")
    _clear(spec)
    return {"name": spec.name, "changed": True, "running": bool(left), "action": "stop", "pid": state["pid"], "signal": signal_used, "left": left,
            "orphans": orphans}


def _stranger(spec: ServiceSpec, state: dict[str, Any] | None, orphans: list[int], *, note: bool = True) -> dict[str, Any]:
    """{"not_ours": reason} when a state file names a live pid or group that is not ours (logged unless note=False)."""
    if not state or orphans or _alive(state):
        return {}
    pgid = int(state.get("pgid") or state["pid"])
    live = [p for p in {int(state["pid"]), *(_group_members(pgid) if pgid > 1 else [])} if not _gone(p)]
    if not live:
        return {}  # gone: nothing to tell apart
    reason = str(not_ours(state))
    if note:
        _note(spec, f"event=not_ours pid={state['pid']} pgid={pgid} live={sorted(live)} reason={reason!r}: not signalled")
    return {"not_ours": reason}


def _gone(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is None or st[0] in ("Z", "X")


def _main_pid_once_started(spec: ServiceSpec, before: int | None, settle_s: float = 30.0, cap_s: float = 600.0) -> int:
    """The new MainPID once systemd has stopped `before` and forked the unit again (a --no-block restart returns
    before either). Waits while the old process is still stopping (`deactivating`: up to the unit's stop timeout,
    bounded by cap_s) and settle_s past that; 0 if no new process came (the health gate then reports a unit that
    never started), never the old pid, so the gate cannot pass on the process that is going away."""
    now = time.monotonic()
    settle, cap = now + settle_s, now + cap_s
    while True:
        st = _systemd_state(spec)
        pid = st["pid"] or 0
        if pid and pid != before:
            return pid
        now = time.monotonic()
        if st["state"] == "deactivating" or (pid and pid == before):
            settle = now + settle_s  # the old process is still there: the new one cannot have started yet
        if now >= settle or now >= cap:
            return 0
        time.sleep(0.1)


def _stop_unit(spec: ServiceSpec, *, check: bool) -> dict[str, Any]:
    running = _systemd_state(spec)["running"]
    if check or not running:
        if not check:
            _clear(spec)
        return {"name": spec.name, "changed": running, "running": running, "action": "stop" if running else "none"}
    for args in (("stop", str(spec.unit)), ("disable", str(spec.unit))):
        _systemctl(*args)
    _clear(spec)
    left = _systemd_state(spec)["running"]
    return {"name": spec.name, "changed": True, "running": left, "action": "stop"}


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def probe(url: str, timeout_s: float = 2.0) -> tuple[bool, str]:
    """GET a health URL: (ok, short reason)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (URLs come from the plan)
            return resp.status == 200, f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        if e.code == 503 and _draining(e):
            return True, "HTTP 503 draining"  # up, drained on purpose (tilepd drain): the gate passes, status shows it
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, str(getattr(e, "reason", e))


def _draining(e: urllib.error.HTTPError) -> bool:
    """A decode node's 503 whose body says it is draining."""
    try:
        body = json.loads(e.read(4096) or b"{}")
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") == "draining"


def wait_healthy(spec: ServiceSpec, *, check: bool = False, log_lines: int = 30) -> dict[str, Any]:
    """Poll the health URL until 200, the process dies, or health_timeout_s passes."""
    base = {"name": spec.name, "changed": False, "health_url": spec.health_url}
    if check or not spec.health_url:
        return {**base, "healthy": None, "failed": False}
    deadline = time.monotonic() + spec.health_timeout_s
    reason = "not probed"
    while True:
        ok, reason = probe(spec.health_url)
        if ok:
            return {**base, "healthy": True, "failed": False}
        alive = _systemd_state(spec)["running"] if spec.mode == "systemd" else _alive(_read_state(spec))
        if not alive:
            reason = f"process exited ({reason})"
            break
        if time.monotonic() >= deadline:
            reason = f"no 200 from {spec.health_url} within {spec.health_timeout_s:.0f}s (last: {reason})"
            break
        time.sleep(0.5)
    return {**base, "healthy": False, "failed": True, "msg": f"{spec.name} unhealthy: {reason}", "log_tail": log_tail(spec, log_lines)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilepd.deploy.proc", description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=("start", "stop", "status", "wait", "version"))
    parser.add_argument("--spec", type=Path, help="service spec JSON")
    parser.add_argument("--check", action="store_true", help="report what would change, change nothing")
    parser.add_argument("--force", action="store_true", help="start: restart even when nothing changed (a decode node drains first)")
    parser.add_argument("--config-hash", help="with --check: the hash the new spec will have (the spec file may not be updated yet)")
    parser.add_argument("--fingerprint", action="store_true", help="status: also the service's deployment fingerprint (reads its checkpoint)")
    args = parser.parse_args(argv)
    if args.verb == "version":
        print(json.dumps({"tilepd_version": __version__, "python": sys.executable, "changed": False}))
        return 0
    if args.spec is None:
        parser.error("--spec is required")
    if not args.spec.exists() and args.verb in ("start", "stop") and (args.check or args.verb == "stop"):
        # start --check: never deployed, so it would start; stop: never deployed, nothing to stop
        would_start = args.verb == "start"
        print(json.dumps({"name": args.spec.name, "changed": would_start, "running": False, "action": "start" if would_start else "none"}))
        return 0
    try:
        spec = load_spec(args.spec)
        if args.check and args.config_hash:
            spec = spec.model_copy(update={"config_hash": args.config_hash})
    except (OSError, ValueError) as e:
        print(json.dumps({"failed": True, "changed": False, "msg": f"{args.spec}: {e}"}))
        return 2
    if args.verb == "start":
        result = start(spec, check=args.check, force=args.force)
    elif args.verb == "stop":
        result = stop(spec, check=args.check)
    elif args.verb == "wait":
        result = wait_healthy(spec, check=args.check)
    else:
        result = status(spec)
        if args.fingerprint:
            result["fingerprint"] = fingerprint_of(spec)
    print(json.dumps(result))
    return 1 if result.get("failed") or (args.verb == "stop" and result.get("running")) else 0


if __name__ == "__main__":
    sys.exit(main())
