"""`tilepd logs`: tail service logs from their hosts, each line prefixed `host/service`.

Process mode reads the log files under `<base_dir>/logs` (size-capped and rotated by
tilepd.deploy.logpipe: `tail -F` follows the new file); systemd mode asks journalctl for the
unit (the units send their output to journald, which bounds its own storage). With `follow`, one reader
thread per service feeds a shared queue so lines from all hosts interleave as they come.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tilepd.deploy.remote import HostShell, HostUnreachable
from tilepd.plan import HostPlan, Plan, Service
from tilepd.runbooks import see


@dataclass(frozen=True)
class Source:
    host: HostPlan
    service: Service

    @property
    def prefix(self) -> str:
        return f"{self.host.name}/{self.service.name}"


def select(plan: Plan, *, role: str | None = None, host: str | None = None) -> list[Source]:
    out = []
    for h in plan.hosts:
        if host is not None and host != h.name:
            continue
        for s in h.services:
            if role is not None and s.role != role:
                continue
            out.append(Source(h, s))
    return out


def _argv(plan: Plan, src: Source, lines: int, follow: bool) -> list[str]:
    if plan.services_mode == "systemd":
        argv = ["journalctl", "--no-pager", "-o", "cat", "-u", src.service.unit, "-n", str(lines)]
        return argv + (["-f"] if follow else [])
    return ["tail", "-n", str(lines), *(["-F"] if follow else []), src.service.log_file]


def tail(plan: Plan, sources: list[Source], *, lines: int = 50, emit: Callable[[str], None], known_hosts: Path | None = None) -> int:
    """Print the last `lines` lines of each source; returns how many sources could not be read."""
    failed = 0
    shells: dict[str, HostShell] = {}
    try:
        for src in sources:
            shell = shells.setdefault(src.host.name, HostShell(src.host, known_hosts=known_hosts))
            try:
                out = shell.run(_argv(plan, src, lines, follow=False))
            except HostUnreachable as e:
                emit(f"{src.prefix} | <unreachable: {e.reason}{see('RB-host-unreachable')}>")
                failed += 1
                continue
            if out.rc != 0:
                emit(f"{src.prefix} | <no log: {out.stderr.strip()[-200:]}>")
                failed += 1
            for line in out.stdout.splitlines():
                emit(f"{src.prefix} | {line}")
    finally:
        for s in shells.values():
            s.close()
    return failed


def follow(plan: Plan, sources: list[Source], *, lines: int = 10, known_hosts: Path | None = None) -> Iterator[str]:
    """Interleaved prefixed lines from every source until the caller stops iterating."""
    q: queue.Queue[str] = queue.Queue(maxsize=10000)
    shells = [HostShell(src.host, known_hosts=known_hosts) for src in sources]

    def pump(src: Source, shell: HostShell) -> None:
        try:
            for line in shell.stream(_argv(plan, src, lines, follow=True)):
                q.put(f"{src.prefix} | {line}")
        except HostUnreachable as e:
            q.put(f"{src.prefix} | <unreachable: {e.reason}{see('RB-host-unreachable')}>")
        except (OSError, ValueError):
            pass  # the stream was closed under us: we are stopping

    for src, shell in zip(sources, shells):
        threading.Thread(target=pump, args=(src, shell), daemon=True).start()
    try:
        while True:
            yield q.get()
    finally:
        for shell in shells:  # stops local `tail -F` children and SSH channels
            shell.close()
