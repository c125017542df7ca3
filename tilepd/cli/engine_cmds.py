"""Engine-side verbs: `convert-weights` and the `dev` helpers (tiny models for tests and demos)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from tilepd.cli._unavailable import not_yet
from tilepd.cli.exitcodes import ExitCode

dev_app = typer.Typer(name="dev", help="Developer helpers: tiny deterministic models for tests and demos.", no_args_is_help=True)


@dev_app.command("tiny-model")
def tiny_model(
    family: str = typer.Argument(..., help="Model family: llama or deepseek_v3."),
    out: Path = typer.Argument(..., help="Directory to write the HF checkpoint into."),
    seed: int = typer.Option(0, help="Seed of the random weights (same seed, same bytes)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Write a tiny random HF checkpoint (weights, tokenizer, chat template) that vLLM and transformers load."""
    from tilepd.dev.tiny_model import FAMILIES, make_tiny_model

    if family not in FAMILIES:
        typer.echo(f"tilepd dev tiny-model: unknown family {family!r}; choose one of {', '.join(FAMILIES)}", err=True)
        raise typer.Exit(int(ExitCode.USAGE))
    path = make_tiny_model(family, out, seed=seed)
    if as_json:
        typer.echo(json.dumps({"family": family, "path": str(path), "seed": seed}))
    else:
        typer.echo(f"wrote tiny {family} model to {path}")


def register(app: typer.Typer) -> None:
    @app.command("convert-weights", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def _convert_weights() -> None:
        """(not yet available)"""
        not_yet("convert-weights")

    app.add_typer(dev_app, name="dev")
