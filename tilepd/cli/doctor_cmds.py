"""`tilepd doctor FILE` (preflight on every host) and `tilepd runbook [ID]` (the on-call runbooks).

Exit codes (tilepd/contracts/exit_codes.py): doctor 0 no required check failed, 9 one did (on a host
that answered), 5 a host was unreachable (and nothing else failed), 3/4 bad topology file;
runbook 0, or 2 for an unknown id.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.markup import escape
from rich.table import Table

from tilepd.contracts.exit_codes import ExitCode

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

_STYLE = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}


def _tables(findings) -> list[Table]:  # noqa: ANN001 - list[tilepd.doctor.Finding]
    """One table per host (check, verdict, what was seen and the fix under it): readable at 80 columns."""
    hosts = list(dict.fromkeys(f.host for f in findings))
    out = []
    for host in hosts:
        table = Table(title=f"tilepd doctor: {host}", title_justify="left", expand=False)
        table.add_column("check", no_wrap=True)
        table.add_column("verdict", no_wrap=True)
        table.add_column("evidence / fix", overflow="fold")
        for f in (f for f in findings if f.host == host):
            verdict = f.verdict + ("" if f.required or f.verdict in ("ok", "skip") else "*")
            detail = escape(f.evidence)
            if f.verdict in ("fail", "warn") and (f.fix or f.runbook):
                detail += f"\n[bold]fix:[/] {escape(f.fix)}" + (f" [bold](tilepd runbook {f.runbook})[/]" if f.runbook else "")
            table.add_row(f.check, f"[{_STYLE[f.verdict]}]{verdict}[/]", detail)
        out.append(table)
    return out


def doctor(
    topology: Path = typer.Argument(..., help="Topology file.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
    host: Optional[list[str]] = typer.Option(None, "--host", help="Only this host: its address (as in `tilepd plan`) or a topology entry name; repeatable."),
    live: bool = typer.Option(True, "--live/--no-live", help="Also look at services already running (state, health, router counters)."),
) -> None:
    """Preflight every host of a topology: versions, GPUs, RDMA, memlock, ports, disk, clock, weights.

    Each check prints an id, a verdict (ok/warn/fail/skip), what was seen and what to do, naming a
    runbook (`tilepd runbook ID`) where one applies. Exit 9 when a required check failed.
    """
    from tilepd.cli.deploy_cmds import _load
    from tilepd.doctor import exit_code
    from tilepd.doctor.runner import run_doctor

    from tilepd.deploy.deployment import resolve_limit

    # paramiko logs a failed handshake with a traceback from its transport thread; the `ssh` finding says it
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    dep = _load(topology)
    names = {h.name for h in dep.plan.hosts}
    try:  # an address, or a topology entry name (as `up --limit`)
        host = resolve_limit(dep, ",".join(host)).split(",") if host else None  # type: ignore[union-attr]
    except ValueError as e:
        err.print(f"[red]--host {str(e).removeprefix('--limit ')}[/]", highlight=False)
        raise typer.Exit(int(ExitCode.USAGE)) from None
    if as_json:
        findings = run_doctor(dep.topology, dep.plan, hosts=host or None, known_hosts=dep.known_hosts, live=live)
    else:
        with console.status(f"checking {len(host or names)} host(s) ..."):
            findings = run_doctor(dep.topology, dep.plan, hosts=host or None, known_hosts=dep.known_hosts, live=live)
    code = exit_code(findings)
    if as_json:
        typer.echo(json.dumps({"deployment": dep.plan.deployment, "exit_code": int(code), "findings": [f.as_json() for f in findings]}, indent=2))
    else:
        for table in _tables(findings):
            console.print(table)
        if any(f.verdict in ("warn", "fail") and not f.required for f in findings):
            console.print("[dim]* informational: does not fail the preflight[/]")
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
    Console().print(Markdown(rb.text()))  # wrapped to the terminal (the shared console soft-wraps: bullets would be cut)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
    app.command("runbook")(runbook)
