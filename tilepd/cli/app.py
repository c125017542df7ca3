"""The `tilepd` command. Each verb family lives in its own module and registers itself here.

`main()` imports only the module of the verb on the command line (the others pull in
Ansible, torch, uvicorn...), so `tilepd plan` starts in a fraction of the full import
time. `--help`, no verb or an unknown verb get every module, so help and did-you-mean
suggestions list everything. `app` (every verb) is built on first use, for tests and
embedding.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Sequence

import typer

from tilepd import __version__

# verb -> the module that defines `register(app: typer.Typer) -> None` for it
VERB_MODULES: dict[str, str] = {
    "validate": "tilepd.cli.topology_cmds",
    "plan": "tilepd.cli.topology_cmds",
    "render": "tilepd.cli.topology_cmds",
    "convert-weights": "tilepd.cli.engine_cmds",
    "dev": "tilepd.cli.engine_cmds",
    "decode-server": "tilepd.cli.runtime_cmds",
    "router": "tilepd.cli.router_cmds",
    "up": "tilepd.cli.deploy_cmds",
    "down": "tilepd.cli.deploy_cmds",
    "status": "tilepd.cli.deploy_cmds",
    "logs": "tilepd.cli.deploy_cmds",
    "doctor": "tilepd.cli.doctor_cmds",
    "runbook": "tilepd.cli.doctor_cmds",
    "drain": "tilepd.cli.drain_cmds",
    "undrain": "tilepd.cli.drain_cmds",
    "capacity": "tilepd.cli.capacity_cmds",
    "trace": "tilepd.cli.trace_cmds",
}


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"tilepd {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
) -> None:
    """tilepd: deploy and run low-latency disaggregated LLM serving."""


def build_app(modules: Iterable[str] | None = None) -> typer.Typer:
    """A Typer app with the verbs of `modules` (default: all of them), in a stable order."""
    wanted = list(dict.fromkeys(VERB_MODULES.values())) if modules is None else list(dict.fromkeys(modules))
    app = typer.Typer(
        name="tilepd",
        help="One topology file to a running disaggregated deployment: stock vLLM prefill, "
        "a batch=1 low-latency decode pool, an OpenAI-compatible router.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for name in wanted:
        importlib.import_module(name).register(app)
    return app


def verb_of(argv: Sequence[str]) -> str | None:
    """The verb on a command line: the first word that is not an option (root options take no value)."""
    for word in argv:
        if not word.startswith("-"):
            return word
        if word in ("--help", "-h"):
            return None
    return None


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    verb = verb_of(args)
    module = VERB_MODULES.get(verb) if verb else None
    build_app([module] if module else None)(args=args, prog_name="tilepd")


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # every verb; built once, on first use
        globals()["app"] = built = build_app()
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
