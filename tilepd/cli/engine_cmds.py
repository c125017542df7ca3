"""Placeholder verbs; replaced by the module's owner."""

from __future__ import annotations

import typer

from tilepd.cli._unavailable import not_yet


def register(app: typer.Typer) -> None:
    @app.command("convert-weights", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _convert_weights() -> None:
        """(not yet available)"""
        not_yet("convert-weights")

