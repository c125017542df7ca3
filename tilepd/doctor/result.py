"""One doctor finding: which check, on which host, the verdict, what was seen and what to do."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from tilepd.contracts.exit_codes import ExitCode

Verdict = Literal["ok", "warn", "fail", "skip"]


@dataclass
class Finding:
    """A required check that fails blocks `up`; a warning or a non-required failure only informs."""

    check: str  # stable id, e.g. `gpu-count`
    host: str
    verdict: Verdict
    evidence: str
    fix: str = ""
    runbook: str | None = None  # RB-... id of the runbook that covers this failure
    required: bool = True

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def ok(check: str, host: str, evidence: str, **kw: Any) -> Finding:
    return Finding(check, host, "ok", evidence, **kw)


def skip(check: str, host: str, why: str, **kw: Any) -> Finding:
    return Finding(check, host, "skip", why, **kw)


def blocking(findings: list[Finding]) -> list[Finding]:
    """Failed checks that are required (the ones that decide the exit code)."""
    return [f for f in findings if f.verdict == "fail" and f.required]


def exit_code(findings: list[Finding]) -> ExitCode:
    """9 when a required check failed on a host that answered, else 5 when a host was unreachable, else 0."""
    failed = blocking(findings)
    if any(f.check != "ssh" for f in failed):
        return ExitCode.PREFLIGHT
    if failed:
        return ExitCode.UNREACHABLE
    return ExitCode.OK
