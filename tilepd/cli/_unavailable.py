"""Placeholder for verbs that a later piece of work fills in."""

from __future__ import annotations

import typer

from tilepd.contracts.exit_codes import ExitCode


def not_yet(verb: str) -> None:
    typer.echo(f"tilepd {verb}: not yet available in this build", err=True)
    raise typer.Exit(int(ExitCode.NOT_AVAILABLE))
