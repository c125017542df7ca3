"""Run small shell commands on one host for the doctor, through the deploy package's HostShell.

Local hosts (127.0.0.1/localhost) run them as subprocesses; others over SSH (paramiko), with the
deployment's known_hosts. Commands go through `sh -c` so a missing tool is exit 127, which the
checks turn into a stated reason instead of a guess.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass

from tilepd.deploy.remote import HostShell, Output

NOT_FOUND = 127


@dataclass
class Probe:
    shell: HostShell

    @property
    def name(self) -> str:
        return self.shell.host.name

    def sh(self, script: str, timeout_s: float = 30.0) -> Output:
        """Run `script` with sh; a timeout is reported as exit 124 with the command in stderr."""
        try:
            return self.shell.run(["sh", "-c", script], timeout_s=timeout_s)
        except (subprocess.TimeoutExpired, TimeoutError):  # TimeoutError: socket.timeout of a paramiko channel
            return Output(124, "", f"{script!r} did not finish within {timeout_s:g} s")

    def has(self, tool: str) -> bool:
        return self.sh(f"command -v {shlex.quote(tool)} >/dev/null 2>&1").rc == 0


def missing_tool(out: Output) -> bool:
    return out.rc == NOT_FOUND


def first_line(text: str, limit: int = 200) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line[:limit]
