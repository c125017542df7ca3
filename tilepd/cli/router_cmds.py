"""`tilepd router --config FILE`: run the OpenAI-compatible router in the foreground."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("router")
    def _router(
        config: Path = typer.Option(..., "--config", help="RouterConfig JSON file (rendered by `tilepd plan`)."),
    ) -> None:
        """Run the router (OpenAI API in front of the low-latency and native pools) until stopped.

        Exit codes: 0 stopped cleanly, 4 the config or API-key file is missing or invalid.
        """
        from tilepd.router.server import serve

        raise typer.Exit(serve(config))
