"""The README is a contract with operators: its exit-code table and commands must match the code."""

from __future__ import annotations

import re
from pathlib import Path

from tilepd.contracts.exit_codes import ExitCode

README = Path(__file__).resolve().parents[1] / "README.md"


def _exit_code_rows() -> dict[int, str]:
    text = README.read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+?) \|$", section, re.M)}


def test_every_exit_code_is_documented_once() -> None:
    rows = _exit_code_rows()
    assert sorted(rows) == sorted(int(c) for c in ExitCode)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in README.read_text()
    assert "bash scripts/test.sh" in ci


def test_readme_lists_every_cli_verb() -> None:
    from tilepd.cli.app import app
    import typer.main

    group = typer.main.get_command(app)
    text = README.read_text()
    for name in group.commands:  # type: ignore[attr-defined]
        assert f"`tilepd {name}" in text, f"README does not document `tilepd {name}`"
