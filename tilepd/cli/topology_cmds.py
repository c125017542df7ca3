"""Placeholder verbs; replaced by the module's owner."""

from __future__ import annotations

import typer

from tilepd.cli._unavailable import not_yet


def register(app: typer.Typer) -> None:
    @app.command("validate", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _validate() -> None:
        """(not yet available)"""
        not_yet("validate")

    @app.command("plan", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _plan() -> None:
        """(not yet available)"""
        not_yet("plan")

    @app.command("render", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _render() -> None:
        """(not yet available)"""
        not_yet("render")

