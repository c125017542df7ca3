"""The on-call runbooks (docs/runbooks/RB-*.md): find, list and read them, installed or from a checkout.

A wheel carries them under tilepd/_bundled/runbooks (pyproject force-include); a checkout keeps
them in docs/runbooks. Each file starts with `# RB-<id>: <title>`; the id is the file name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUNBOOK_ID = re.compile(r"\bRB-[a-z0-9]+(?:-[a-z0-9]+)*\b")
_PKG = Path(__file__).resolve().parent.parent


class RunbookNotFound(KeyError):
    pass


@dataclass(frozen=True)
class Runbook:
    id: str
    title: str
    path: Path

    def text(self) -> str:
        return self.path.read_text()


def runbooks_dir() -> Path:
    for candidate in (_PKG / "_bundled" / "runbooks", _PKG.parent / "docs" / "runbooks"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"runbooks not found under {_PKG}/_bundled/runbooks or {_PKG.parent}/docs/runbooks (broken install?)")


def _title(path: Path) -> str:
    first = path.read_text().splitlines()[0] if path.stat().st_size else ""
    return first.lstrip("# ").partition(":")[2].strip() or path.stem


def all_runbooks() -> list[Runbook]:
    return [Runbook(p.stem, _title(p), p) for p in sorted(runbooks_dir().glob("RB-*.md"))]


def get(runbook_id: str) -> Runbook:
    """The runbook `runbook_id` (`RB-` prefix optional, case-insensitive)."""
    want = runbook_id if runbook_id.upper().startswith("RB-") else f"RB-{runbook_id}"
    want = "RB-" + want[3:].lower()
    for rb in all_runbooks():
        if rb.id == want:
            return rb
    raise RunbookNotFound(f"no runbook {runbook_id!r}; there are: {', '.join(r.id for r in all_runbooks())}")
