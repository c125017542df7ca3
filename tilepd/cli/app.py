"""The `tilepd` command. Each verb family lives in its own module and registers itself here."""

from __future__ import annotations

import importlib

import typer

from tilepd import __version__

app = typer.Typer(
    name="tilepd",
    help="One topology file to a running disaggregated deployment: stock vLLM prefill, "
    "a batch=1 low-latency decode pool, an OpenAI-compatible router.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules that each define `register(app: typer.Typer) -> None`.
_VERB_MODULES = (
    "tilepd.cli.topology_cmds",  # validate, plan, render
    "tilepd.cli.engine_cmds",  # convert-weights, dev tiny-model
    "tilepd.cli.runtime_cmds",  # decode-server
    "tilepd.cli.router_cmds",  # router
    "tilepd.cli.deploy_cmds",  # up, down, status, logs
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"tilepd {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
) -> None:
    """tilepd: deploy and run low-latency disaggregated LLM serving."""


for _name in _VERB_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
