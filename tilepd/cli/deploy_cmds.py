"""Placeholder verbs; replaced by the module's owner."""

from __future__ import annotations

import typer

from tilepd.cli._unavailable import not_yet


def register(app: typer.Typer) -> None:
    @app.command("up", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _up() -> None:
        """(not yet available)"""
        not_yet("up")

    @app.command("down", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _down() -> None:
        """(not yet available)"""
        not_yet("down")

    @app.command("status", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _status() -> None:
        """(not yet available)"""
        not_yet("status")

    @app.command("logs", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _logs() -> None:
        """(not yet available)"""
        not_yet("logs")

