"""Exit codes of the tilepd CLI. The README's table is checked against this module by a test."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1  # unexpected failure (a bug, or an environment problem tilepd cannot name better)
    USAGE = 2  # bad command line (typer/click's own code)
    INVALID = 3  # topology failed schema or cross-role validation
    INPUT = 4  # an input file is missing or corrupt (checkpoint, converted weights, manifest)
    UNREACHABLE = 5  # a host could not be reached over SSH (named in the message)
    TASK_FAILED = 6  # an Ansible task failed (host, task and the module's message are printed)
    UNHEALTHY = 7  # a service failed its health gate or the canary, or status found it degraded
    NOT_AVAILABLE = 8  # the verb exists but this build does not implement it yet
    PREFLIGHT = 9  # `tilepd doctor`: a required preflight check failed on a host (check id, evidence, fix printed)
    NOT_DRAINED = 10  # `tilepd drain`: the node was still busy when --timeout ran out (it stays draining)
    NOT_FOUND = 11  # `tilepd trace`: no log line names that request id (or its final line is not written yet)
