"""Exit codes of every `tilepd` verb and the router process, with their meanings.

The README's table is checked against this module by a test; docs/TOPOLOGY.md's table is generated from it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    INVALID = 3
    INPUT = 4
    UNREACHABLE = 5
    TASK_FAILED = 6
    UNHEALTHY = 7
    NOT_AVAILABLE = 8
    PREFLIGHT = 9
    NOT_DRAINED = 10
    NOT_FOUND = 11


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.ERROR: "unexpected failure (a bug, or an environment problem tilepd cannot name better)",
    ExitCode.USAGE: "bad command line (unknown option, missing argument, unusable `--out` folder)",
    ExitCode.INVALID: "the topology failed schema or cross-role validation; every finding is printed as `file:line:col: field.path: message [rule]`",
    ExitCode.INPUT: "an input file is missing, unreadable or not YAML (the YAML error's line is printed), or a checkpoint / converted-weights input is corrupt",
    ExitCode.UNREACHABLE: "a host could not be reached over SSH (named in the message)",
    ExitCode.TASK_FAILED: "an Ansible task failed (host, task and the module's message are printed)",
    ExitCode.UNHEALTHY: "a service failed its health gate or the canary, or status found it degraded",
    ExitCode.NOT_AVAILABLE: "the verb exists but this build does not implement it yet",
    ExitCode.PREFLIGHT: "`tilepd doctor`: a required preflight check failed on a host (check id, evidence, fix and runbook printed)",
    ExitCode.NOT_DRAINED: "`tilepd drain`: the node was still busy when `--timeout` ran out (it stays draining; run drain again or undrain)",
    ExitCode.NOT_FOUND: "`tilepd trace`: no router log line names that request id, or its final line is not written yet (still running, or the log rotated away)",
}
