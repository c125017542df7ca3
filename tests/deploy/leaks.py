"""Where a deployment's secrets must never show up: files on the operator's side, service logs, process argv/environ."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tests.deploy.cli import processes_mentioning


def leaks(secrets: Iterable[str], folders: Iterable[Path], process_marker: str) -> list[str]:
    """Every place (file path, or `pid N argv|environ`) holding one of `secrets`; [] when none does.

    `folders` are searched recursively (render folder, runner folder, service logs);
    processes are those whose command line contains `process_marker` (the deployment's base_dir).
    """
    wanted = [s.encode() for s in secrets if s]
    assert wanted, "no secret to look for"
    found = []
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                found += [f"{path}" for s in wanted if s in data]
    for pid, _ in processes_mentioning(process_marker):
        for what in ("cmdline", "environ"):
            try:
                data = Path(f"/proc/{pid}/{what}").read_bytes()
            except OSError:
                continue
            found += [f"pid {pid} {what}" for s in wanted if s in data]
    return found
