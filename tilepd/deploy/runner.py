"""Run one of tilepd's playbooks through ansible-runner and digest its event stream.

The CLI wants three things from a run: live progress (per host, per task), the
number of changed tasks per host (a second `up` must report 0), and, when it fails,
the exact host, task and module message (exit 5 or 6), or the service whose health
gate failed with its last log lines (exit 7).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tilepd.deploy import host_keys
from tilepd.deploy.secrets import SOCKET_ENV, serve
from tilepd.resources import playbooks_dir
from tilepd.runbooks import cite

# Task names that gate on health start with this prefix; their failure means exit 7, not 6.
HEALTH_TASK_PREFIX = "health gate"


@dataclass
class TaskFailure:
    host: str
    task: str
    message: str
    unreachable: bool = False
    health: bool = False
    service: str | None = None
    log_tail: list[str] = field(default_factory=list)


@dataclass
class TaskEvent:
    """What the progress display needs from one ansible-runner event."""

    kind: str  # play | task | ok | changed | skipped | failed | unreachable | stats
    host: str | None = None
    task: str | None = None
    play: str | None = None
    message: str | None = None


@dataclass
class PlaybookResult:
    playbook: str
    status: str  # successful | failed | canceled | timeout
    rc: int
    changed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ok: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    failures: list[TaskFailure] = field(default_factory=list)
    # JSON lines printed by `python -m tilepd.deploy.proc` tasks, per host
    service_results: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    @property
    def total_changed(self) -> int:
        return sum(self.changed.values())

    @property
    def unreachable(self) -> list[TaskFailure]:
        return [f for f in self.failures if f.unreachable]


def _message(res: dict[str, Any]) -> str:
    """The most useful one-paragraph message from a module result.

    tilepd's helper modules print a JSON line with `msg`; that beats the command
    module's generic "non-zero return code".
    """
    failed_items = [r for r in res.get("results") or [] if isinstance(r, dict) and r.get("failed")]
    if failed_items:  # a loop: the first failed item says more than "One or more items failed"
        item = failed_items[0]
        label = (item.get("_ansible_item_label") or item.get("item") or "")
        label = label.get("name", "") if isinstance(label, dict) else str(label)
        return (f"[{label}] " if label else "") + _message(item)
    parsed = _json_line(str(res.get("stdout") or ""))
    if parsed and parsed.get("msg"):
        return str(parsed["msg"])
    generic = str(res.get("msg") or "").strip()
    for key in ("stderr", "module_stderr", "stdout"):
        val = str(res.get(key) or "").strip()
        if val and (not generic or generic == "non-zero return code" or key == "module_stderr"):
            return (f"{generic}: " if generic else "") + val[-2000:]
    return generic or json.dumps(res)[:2000]


def _json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


class _Digest:
    """Folds ansible-runner events into a PlaybookResult and forwards TaskEvents."""

    def __init__(self, result: PlaybookResult, on_event: Callable[[TaskEvent], None] | None, known_hosts: Path | None = None,
                 endpoints: Mapping[str, tuple[str, int]] | None = None) -> None:
        self.result = result
        self.on_event = on_event
        self.known_hosts, self.endpoints = known_hosts, endpoints or {}

    def _emit(self, ev: TaskEvent) -> None:
        if self.on_event is not None:
            self.on_event(ev)

    def __call__(self, event: dict[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        host = data.get("host") or data.get("remote_addr")
        task = (data.get("task") or "").strip()
        res = data.get("res") or {}
        if kind == "playbook_on_play_start":
            self._emit(TaskEvent("play", play=data.get("play")))
        elif kind == "playbook_on_task_start":
            self._emit(TaskEvent("task", task=task, play=data.get("play")))
        elif kind == "runner_on_ok":
            changed = bool(res.get("changed"))
            (self.result.changed if changed else self.result.ok)[host] += 1
            self._collect_service(host, res)
            self._emit(TaskEvent("changed" if changed else "ok", host=host, task=task))
        elif kind in ("runner_on_skipped",):
            self._emit(TaskEvent("skipped", host=host, task=task))
        elif kind == "runner_on_failed" and not data.get("ignore_errors"):
            self.result.failures.append(self._failure(host, task, res))
            self._emit(TaskEvent("failed", host=host, task=task, message=self.result.failures[-1].message))
        elif kind == "runner_on_unreachable":
            address, port = self.endpoints.get(host or "", (host or "?", 22))
            ssh_said = " ".join([_message(res), *(str(r.get("msg", "")) for r in res.get("results") or [] if isinstance(r, dict))])  # a loop's items
            msg = _message(res) if ssh_said == _message(res) else ssh_said.strip()
            msg = cite(host_keys.explain_ssh_failure(msg, host or "?", self.known_hosts, address, port), "RB-host-unreachable")
            self.result.failures.append(TaskFailure(host=host or "?", task=task, message=msg, unreachable=True))
            self._emit(TaskEvent("unreachable", host=host, task=task, message=msg))
        elif kind == "runner_item_on_ok" and res.get("changed"):
            pass  # counted once by runner_on_ok of the loop task
        elif kind == "playbook_on_stats":
            # an unreachable result of a task with ignore_unreachable (the secrets play asks every host, down ones too)
            # is no failure: Ansible's own stats count a host unreachable ("dark") only when it was not ignored
            dark = data.get("dark") or {}
            self.result.failures = [f for f in self.result.failures if not f.unreachable or f.host in dark]
        return True

    def _collect_service(self, host: str, res: dict[str, Any]) -> None:
        for item in res.get("results") or [res]:  # loop tasks report per item
            if not isinstance(item, dict):
                continue
            parsed = _json_line(str(item.get("stdout") or ""))
            if parsed is not None and "name" in parsed:
                self.result.service_results[host].append(parsed)

    def _failure(self, host: str, task: str, res: dict[str, Any]) -> TaskFailure:
        failure = TaskFailure(host=host or "?", task=task, message=_message(res))
        if task.startswith(HEALTH_TASK_PREFIX):
            failed_items = [r for r in res.get("results") or [] if isinstance(r, dict) and r.get("failed")]
            parsed = _json_line(str((failed_items[0] if failed_items else res).get("stdout") or "")) or {}
            failure.health = True
            failure.service = parsed.get("name")
            failure.log_tail = list(parsed.get("log_tail") or [])
            failure.message = parsed.get("msg") or failure.message
            if any("address already in use" in line.lower() for line in [failure.message, *failure.log_tail]):
                failure.message = cite(failure.message, "RB-orphaned-ports")  # a leftover of an earlier run holds the port
        return failure


def run_playbook(
    playbook: str,
    *,
    inventory: Path,
    private_dir: Path,
    extravars: dict[str, Any] | None = None,
    limit: str | None = None,
    tags: str | None = None,
    check: bool = False,
    on_event: Callable[[TaskEvent], None] | None = None,
    forks: int = 10,
    known_hosts: Path | None = None,
    secret_env: tuple[str, ...] = (),
    secrets: Mapping[str, str] | None = None,
) -> PlaybookResult:
    """Run `playbooks/<playbook>` against the generated inventory; never raises on task failure."""
    import ansible_runner  # heavy import, only when deploying

    private_dir.mkdir(parents=True, exist_ok=True)
    # ansible-runner re-reads env/ (cmdline, extravars) of earlier runs: start clean
    shutil.rmtree(private_dir / "env", ignore_errors=True)
    result = PlaybookResult(playbook=playbook, status="unknown", rc=-1)
    digest = _Digest(result, on_event, known_hosts, host_keys.inventory_endpoints(inventory))
    bindir = str(Path(sys.executable).parent)
    # the static settings are in playbooks/ansible.cfg (an `ansible-playbook` run by hand reads them too); only what
    # changes per run is here
    envvars = {
        # the controller's own ansible-playbook (the venv's), whatever PATH the operator has
        "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
        "ANSIBLE_CONFIG": str(playbooks_dir() / "ansible.cfg"),
        # ansible-runner sets ANSIBLE_HOST_KEY_CHECKING=False unless it is given, which would override ansible.cfg's
        # True (ssh_args' StrictHostKeyChecking=accept-new comes first on ssh's command line and wins either way)
        "ANSIBLE_HOST_KEY_CHECKING": "True",
    }
    if known_hosts:  # host keys are recorded per deployment (trust on first use), not in the operator's ~/.ssh
        envvars["ANSIBLE_SSH_EXTRA_ARGS"] = f"-o UserKnownHostsFile={known_hosts}"
    cmdline = "--check" if check else None
    # ansible-runner records the environment of ansible-playbook in artifacts/<id>/command:
    # keep secrets the operator exported (e.g. the router's API key) out of it; the playbook gets
    # `secrets` from a socket served for this run (tilepd.deploy.secrets), only its path is in the env.
    hidden = {name: os.environ.pop(name) for name in secret_env if name in os.environ}
    try:
        with serve(secrets) if secrets is not None else nullcontext(None) as socket_path:
            if socket_path is not None:
                envvars[SOCKET_ENV] = str(socket_path)
            r = ansible_runner.run(
                private_data_dir=str(private_dir),
                project_dir=str(playbooks_dir()),
                playbook=playbook,
                inventory=str(inventory),
                extravars=extravars or {},
                limit=limit,
                tags=tags,
                cmdline=cmdline,
                envvars=envvars,
                forks=forks,
                quiet=True,
                event_handler=digest,
                settings={"suppress_ansible_output": True},
                rotate_artifacts=5,
                suppress_env_files=True,
            )
    finally:
        os.environ.update(hidden)
    result.status = r.status
    result.rc = r.rc
    return result
