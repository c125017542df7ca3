"""`tilepd validate | plan | render`: topology file -> findings, plan, rendered files.

Exit codes (tilepd/contracts/exit_codes.py): 0 ok, 3 the topology is invalid, 4 the file is
missing / unreadable / not YAML, 2 bad command line or unusable --out folder.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from tilepd.contracts.exit_codes import ExitCode
from tilepd.topology import Topology, TopologyError, TopologyFileError, load_topology

if TYPE_CHECKING:
    from tilepd.topology.memory_fit import MemoryReport

FILE_ARG = typer.Argument(..., help="Topology file (YAML, apiVersion: tilepd/v1).", show_default=False)
JSON_OPT = typer.Option(False, "--json", help="Machine-readable JSON on stdout.")


def _fail(code: ExitCode, findings: list[dict[str, object]], lines: list[str], as_json: bool, file: Path) -> NoReturn:
    if as_json:
        typer.echo(json.dumps({"file": str(file), "valid": False, "exit_code": int(code), "findings": findings}, indent=2))
    else:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        for line in lines:
            err.print(line, markup=False)
        noun = "problem" if len(lines) == 1 else "problems"
        err.print(f"{file}: {len(lines)} {noun}; see docs/TOPOLOGY.md", markup=False, style="bold red")
    raise typer.Exit(int(code))


def load_or_exit(file: Path, as_json: bool) -> Topology:
    """Load and validate, or print every finding and exit 3 (invalid) / 4 (unreadable)."""
    try:
        return load_topology(file)
    except TopologyFileError as exc:
        _fail(ExitCode.INPUT, [exc.to_dict()], [str(exc)], as_json, file)
    except TopologyError as exc:
        _fail(ExitCode.INVALID, [f.to_dict() for f in exc.findings], [f.format() for f in exc.findings], as_json, file)


def summarise_argv(argv: list[str], python: str | None = None, limit: int = 60) -> str:
    """argv for a table cell: the interpreter as `python`, long words (JSON configs) by size, not content."""
    words = []
    for i, word in enumerate(argv):
        if i == 0 and word == python:
            words.append("python")
            continue
        if len(word) > limit:
            kind = "json" if word.lstrip().startswith(("{", "[")) else "text"
            words.append(f"<{kind} {len(word)} B>")
        else:
            words.append(shlex.quote(word))
    return " ".join(words)


def print_memory(console: Console, report: "MemoryReport") -> None:
    """The per-GPU memory table of rule memory-fit (or why there is none)."""
    from tilepd.topology.memory_fit import PARTS, gib

    if report.not_checked:
        console.print(f"GPU memory: not checked: {report.not_checked}", markup=False)
        return
    if not report.rows:
        console.print(f"GPU memory: no GPU host states its GPU type (model figures: {report.source})", markup=False)
        return
    table = Table(title=f"GPU memory, per GPU (model figures: {report.source})", title_justify="left", expand=False)
    for col in ("host", "GPUs", "weights", "MTP", "KV cache", "indexer", "recv buffer", "workspace", "total", "GPU has", "fits"):
        table.add_column(col, justify="left" if col in ("host", "GPUs", "GPU has") else "right")
    for row in report.rows:
        fits = {True: "yes", False: "NO", None: "?"}[row.fits]
        memory = f"{gib(row.capacity)} {row.gpu_short}" if row.capacity is not None else "unknown GPU type"
        table.add_row(f"{row.role} {row.name}", f"{row.gpus}: {row.detail}", *(gib(row.parts[p]) for p in PARTS), gib(row.total), memory, fits)
    console.print(table)
    for gpu in sorted({row.gpu for row in report.rows if row.gpu}):
        console.print(f"  {gpu}", markup=False)


def register(app: typer.Typer) -> None:
    @app.command("validate")
    def validate(file: Path = FILE_ARG, as_json: bool = JSON_OPT) -> None:
        """Check a topology: schema, then the cross-role rules. Exit 3 with every finding (file:line:col) if invalid."""
        from tilepd.topology.memory_fit import memory_report

        topo = load_or_exit(file, as_json)
        report = memory_report(topo)
        if as_json:
            typer.echo(json.dumps({"file": str(file), "valid": True, "exit_code": 0, "findings": [], "memory": report.to_dict()}, indent=2))
            return
        n_hosts = len({e.address for e in (*topo.prefill, *topo.decode, *topo.native_decode, *topo.all_routers)})
        console = Console(highlight=False)
        console.print(
            f"{file}: valid ({topo.deployment.name}: {len(topo.prefill)} prefill, {len(topo.decode)} decode, "
            f"{len(topo.native_decode)} native decode on {n_hosts} host{'s' if n_hosts != 1 else ''}; transport {topo.transport.name})",
            markup=False,
        )
        print_memory(console, report)

    @app.command("plan")
    def plan(file: Path = FILE_ARG, as_json: bool = JSON_OPT) -> None:
        """Show what every host will run: services, ports, commands. `--json` prints the complete plan."""
        from tilepd.plan import build_plan

        the_plan = build_plan(load_or_exit(file, as_json))
        if as_json:
            typer.echo(the_plan.model_dump_json(indent=2))
            return
        console = Console(highlight=False, soft_wrap=False)
        console.print(
            f"deployment [bold]{the_plan.deployment}[/bold]  services: {the_plan.services_mode}  transport: {the_plan.transport}  "
            f"base_dir: {the_plan.base_dir}  topology {the_plan.topology_hash[:19]}"
        )
        for host in the_plan.hosts:
            via = "local" if host.local else f"ssh {host.ssh.user + '@' if host.ssh.user else ''}{host.address}:{host.ssh.port}"
            pythons = ", ".join(e.python for e in host.environments)
            table = Table(title=f"{host.name} ({', '.join(host.roles)}; {via}; python {pythons})", title_justify="left", expand=False)
            table.add_column("stage", justify="right")
            table.add_column("service")
            table.add_column("ports")
            table.add_column("command", overflow="fold")
            for svc in host.services:
                ports = ", ".join(f"{k} {v}" for k, v in svc.ports.items()) or "-"
                cores = f" cores {svc.env['VLLM_CPU_OMP_THREADS_BIND']}" if "VLLM_CPU_OMP_THREADS_BIND" in svc.env else ""
                table.add_row(str(svc.stage), f"{svc.name} ({svc.kind}){cores}", ports, summarise_argv(svc.argv, svc.python))
            console.print(table)

    @app.command("render")
    def render(
        file: Path = FILE_ARG,
        out: Path = typer.Option(..., "--out", help="Folder to write (replaced as a whole if it holds an earlier render).", show_default=False),
        as_json: bool = JSON_OPT,
    ) -> None:
        """Write the plan as files: plan.json, inventory.yml, and per host its units, env files and configs."""
        from tilepd.plan import RenderError, build_plan, render_plan

        the_plan = build_plan(load_or_exit(file, as_json))
        try:
            written = render_plan(the_plan, out)
        except RenderError as exc:
            typer.echo(f"tilepd render: {exc}", err=True)
            raise typer.Exit(int(ExitCode.USAGE)) from None
        except OSError as exc:  # a folder that cannot be created or written: /proc/..., read-only, no permission
            where = exc.filename or out
            typer.echo(f"tilepd render: cannot write --out {out.absolute()}: {exc.strerror or exc} ({where})", err=True)
            raise typer.Exit(int(ExitCode.USAGE)) from None
        if as_json:
            typer.echo(json.dumps({"out": str(out.absolute()), "topology_hash": the_plan.topology_hash, "files": [str(p) for p in written]}, indent=2))
        else:
            n = len(the_plan.hosts)
            typer.echo(f"wrote {len(written)} files for {n} host{'s' if n != 1 else ''} to {out.absolute()}")
