"""`tilepd doctor FILE` (preflight on every host) and `tilepd runbook [ID]` (the on-call runbooks).

Exit codes (tilepd/cli/exitcodes.py): doctor 0 no required check failed, 9 one did (on a host
that answered), 5 a host was unreachable (and nothing else failed), 3/4 bad topology file;
runbook 0, or 2 for an unknown id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from tilepd.cli.exitcodes import ExitCode

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

_STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}


def _table(findings) -> Table:  # noqa: ANN001 - list[tilepd.doctor.Finding]
    table = Table(title="tilepd doctor", title_justify="left")
    for col in ("host", "check", "verdict", "evidence", "fix"):
        table.add_column(col, overflow="fold")
    for f in findings:
        verdict = f.verdict + ("" if f.required or f.verdict in ("ok", "skip") else " (info)")
        fix = f.fix + (f" [bold]runbook {f.runbook}[/]" if f.runbook and f.verdict in ("fail", "warn") else "")
        table.add_row(f.host, f.check, f"[{_STYLE[f.verdict]}]{verdict}[/]", f.evidence, fix)
    return table


def doctor(
    topology: Path = typer.Argument(..., help="Topology file.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
    host: Optional[list[str]] = typer.Option(None, "--host", help="Only this host (address as in `tilepd plan`; repeatable)."),
    live: bool = typer.Option(True, "--live/--no-live", help="Also look at services already running (state, health, router counters)."),
) -> None:
    """Preflight every host of a topology: versions, GPUs, RDMA, memlock, ports, disk, clock, weights.

    Each check prints an id, a verdict (ok/warn/fail/skip), what was seen and what to do, naming a
    runbook (`tilepd runbook ID`) where one applies. Exit 9 when a required check failed.
    """
    from tilepd.cli.deploy_cmds import _load
    from tilepd.doctor import exit_code
    from tilepd.doctor.runner import run_doctor

    dep = _load(topology)
    names = {h.name for h in dep.plan.hosts}
    unknown = [h for h in host or [] if h not in names]
    if unknown:
        err.print(f"[red]--host {', '.join(unknown)}: not a host of {topology}[/]; hosts: {', '.join(sorted(names))}", highlight=False)
        raise typer.Exit(int(ExitCode.USAGE))
    if as_json:
        findings = run_doctor(dep.topology, dep.plan, hosts=host or None, known_hosts=dep.known_hosts, live=live)
    else:
        with console.status(f"checking {len(host or names)} host(s) ..."):
            findings = run_doctor(dep.topology, dep.plan, hosts=host or None, known_hosts=dep.known_hosts, live=live)
    code = exit_code(findings)
    if as_json:
        typer.echo(json.dumps({"deployment": dep.plan.deployment, "exit_code": int(code), "findings": [f.as_json() for f in findings]}, indent=2))
    else:
        console.print(_table(findings))
        failed = [f for f in findings if f.verdict == "fail" and f.required]
        if failed:
            books = sorted({f.runbook for f in failed if f.runbook})
            more = f"; runbooks: {', '.join(books)} (`tilepd runbook ID`)" if books else ""
            console.print(f"[red]{len(failed)} required check(s) failed[/]{more}", highlight=False)
        else:
            console.print("[green]preflight ok[/]")
    raise typer.Exit(int(code))


def runbook(runbook_id: Optional[str] = typer.Argument(None, metavar="[ID]", help="Runbook id, e.g. RB-decode-down; none: list them.")) -> None:
    """Print an on-call runbook in the terminal, or list them all."""
    from tilepd.doctor.runbooks import RunbookNotFound, all_runbooks, get

    if runbook_id is None:
        table = Table(title="tilepd runbooks", title_justify="left")
        table.add_column("id")
        table.add_column("failure mode")
        for rb in all_runbooks():
            table.add_row(rb.id, rb.title)
        console.print(table)
        return
    try:
        rb = get(runbook_id)
    except RunbookNotFound as e:
        err.print(f"[red]{e.args[0]}[/]", highlight=False)
        raise typer.Exit(int(ExitCode.USAGE)) from None
    console.print(Markdown(rb.text()))


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
    app.command("runbook")(runbook)
