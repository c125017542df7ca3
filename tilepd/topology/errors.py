"""Findings and the exceptions that carry them.

A finding always names where the problem is (file, line, column, field path), so an
operator can jump to it; the rule id lets scripts and tests tell findings apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    """One thing wrong with a topology file."""

    file: str
    line: int  # 1-based; 0 when the position is unknown
    col: int  # 1-based; 0 when the position is unknown
    path: str  # dotted field path, e.g. "prefill[0].port"; "" for the whole document
    message: str
    rule: str  # "schema.unknown-key", "port-collision", ...

    def format(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}"
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.message} [{self.rule}]"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class TopologyError(Exception):
    """The file is YAML but not a valid topology (exit code 3)."""

    def __init__(self, findings: list[Finding]):
        self.findings = sorted(findings, key=lambda f: (f.line, f.col, f.rule, f.message))
        super().__init__("\n".join(f.format() for f in self.findings))


class TopologyFileError(Exception):
    """The file is missing, unreadable, or not YAML (exit code 4)."""

    def __init__(self, file: str, message: str, line: int = 0, col: int = 0):
        self.file, self.line, self.col, self.message = file, line, col, message
        where = f"{file}:{line}:{col}" if line else file
        super().__init__(f"{where}: {message}")

    def to_dict(self) -> dict[str, object]:
        return {"file": self.file, "line": self.line, "col": self.col, "path": "", "message": self.message, "rule": "file"}
