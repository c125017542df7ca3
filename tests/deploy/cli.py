"""Run the real `tilepd` CLI as a subprocess, as an operator would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Run:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        return self.stdout + self.stderr

    def json(self) -> Any:
        return json.loads(self.stdout)

    def changed(self) -> int:
        """The `changed: N` line `tilepd up` prints."""
        for line in self.stdout.splitlines():
            if line.startswith("changed: "):
                return int(line.split()[1])
        raise AssertionError(f"no 'changed:' line in output:\n{self.out}")

    def __str__(self) -> str:
        return f"$ {' '.join(self.argv)} -> {self.rc}\n{self.out}"


def tilepd(home: Path, *args: str, timeout: float = 900) -> Run:
    """`python -m tilepd ARGS` with its per-deployment state under `home`."""
    env = dict(os.environ, TILEPD_HOME=str(home), COLUMNS="200", NO_COLOR="1")
    argv = [sys.executable, "-m", "tilepd", *args]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    return Run(argv, p.returncode, p.stdout, p.stderr)


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of every live process whose command line contains `text`."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
        if text in cmd and state != "Z" and int(entry.name) != os.getpid():
            out.append((int(entry.name), cmd))
    return out
