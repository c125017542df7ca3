"""`tilepd up / down / status / logs`: deploy a topology with Ansible, and watch it.

Exit codes (tilepd/contracts/exit_codes.py): 0 ok, 3 invalid topology, 4 unreadable file,
5 unreachable host (named), 6 a task failed (host, task, module message),
7 a health gate / the canary failed or status found something degraded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tilepd.contracts.exit_codes import ExitCode

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

DEFAULT_TOPOLOGY = "local.yaml"


def _topology_arg(path: Optional[Path]) -> Path:
    """The given file, or the embedded default `topology_examples/local.yaml`."""
    if path is not None:
        return path
    from tilepd.resources import examples_dir

    return examples_dir() / DEFAULT_TOPOLOGY


def _load(path: Optional[Path]):  # noqa: ANN202 - returns tilepd.deploy.deployment.Deployment
    from tilepd.deploy import deployment
    from tilepd.topology import TopologyError, TopologyFileError

    file = _topology_arg(path)
    try:
        return deployment.load(file)
    except TopologyFileError as e:
        err.print(f"[red]{e}[/]")
        raise typer.Exit(int(ExitCode.INPUT)) from None
    except TopologyError as e:
        err.print(f"[red]{file}: invalid topology[/]\n{e}", highlight=False)
        raise typer.Exit(int(ExitCode.INVALID)) from None


def _report_failures(result, dep) -> None:  # noqa: ANN001
    from tilepd.deploy.proc import tail

    for f in result.failures:
        if f.unreachable:
            err.print(f"[red]unreachable host {f.host}[/]: {f.message.strip()}", highlight=False)
        elif f.health:
            err.print(f"[red]health gate failed on {f.host}: {f.message}[/]", highlight=False)
            lines = f.log_tail
            if not lines and f.service:
                try:
                    lines = tail(Path(dep.plan.service(f.service, f.host).log_file), 20)
                except KeyError:
                    lines = []
            if lines:
                err.print(f"  last log lines of {f.service}:", highlight=False)
                for line in lines[-20:]:
                    err.print(f"    {line}", highlight=False, markup=False)
        else:
            err.print(f"[red]task failed on {f.host}[/]: [bold]{f.task}[/]\n  {f.message.strip()}", highlight=False)


def _run_playbook(dep, playbook: str, *, title: str, limit, only, check, extravars=None):  # noqa: ANN001, ANN202
    from tilepd.deploy import deployment
    from tilepd.deploy.progress import Progress, summary_table

    try:
        with Progress(console) as progress:
            result = deployment.run(dep, playbook, limit=limit, only=only, check=check, extravars=extravars, on_event=progress)
    except ValueError as e:
        err.print(f"[red]{e}[/]")
        raise typer.Exit(int(ExitCode.USAGE)) from None
    console.print(summary_table(result, dep.host_names(), f"{title}{' (check mode: nothing changed)' if check else ''}"))
    return result


def _canary_logs(dep, service_name: str) -> list[str]:  # noqa: ANN001
    from tilepd.deploy.logs import select, tail

    lines: list[str] = []
    sources = [s for s in select(dep.plan) if s.service.name == service_name]
    tail(dep.plan, sources, lines=20, emit=lines.append, known_hosts=dep.known_hosts)
    return lines


def up(
    topology: Optional[Path] = typer.Argument(None, help="Topology file; default: the embedded topology_examples/local.yaml."),
    limit: Optional[str] = typer.Option(None, "--limit", help="Only these hosts (address or topology entry name; comma-separated)."),
    only: Optional[str] = typer.Option(None, "--only", help="Only this role: decode, native_decode, prefill, router, balancer, weights."),
    check: bool = typer.Option(False, "--check", help="Show what would change; change nothing."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask before changing remote hosts."),
    canary: bool = typer.Option(True, "--canary/--no-canary", help="Finish with one real request through the router."),
    force: bool = typer.Option(False, "--force", help="Restart every decode node and router (one at a time, each drained first) even if unchanged."),
) -> None:
    """Deploy a topology: validate, render, run the playbooks, gate on health, send a canary.

    Running decode nodes that must restart (config, secret or tilepd version changed; all with --force) are
    restarted one at a time: drained (their request finishes, new ones go elsewhere), restarted, health-gated.
    Routers behind a balancer likewise: drained at the balancer, their streams ended, restarted, put back.
    """
    from tilepd.deploy import deployment, probes

    dep = _load(topology)
    remote = [h.name for h in dep.plan.hosts if not h.local]
    if remote and not yes and not check and not typer.confirm(f"Deploy {dep.plan.deployment} to {', '.join(remote)}?", default=True):
        raise typer.Exit(int(ExitCode.OK))
    deployment.render(dep)
    console.print(f"[bold]tilepd up[/] {dep.plan.deployment}: {len(dep.plan.hosts)} host(s), render in {dep.render_dir}")
    result = _run_playbook(dep, "up.yml", title="tilepd up", limit=limit, only=only, check=check,
                           extravars={"tilepd_force_restart": True} if force else None)
    code = deployment.exit_code(result)
    if code != ExitCode.OK:
        _report_failures(result, dep)
        raise typer.Exit(int(code))
    console.print(f"changed: {result.total_changed}")
    if check:
        return
    router = next((s for h in dep.plan.hosts for s in h.services if s.role == "router"), None)
    full = limit is None and only is None
    if canary and full and router is not None:
        with console.status("canary: one chat request through the router ..."):
            c = probes.canary(dep.plan, dep.topology.model.served_name)
        if not c.ok:
            err.print(f"[red]canary failed[/]: {c.message}", highlight=False)
            if c.failed_service:
                for line in _canary_logs(dep, c.failed_service):
                    err.print(f"  {line}", highlight=False, markup=False)
            raise typer.Exit(int(ExitCode.UNHEALTHY))
        console.print(
            f"canary ok: {c.completion_tokens} tokens in {c.seconds:.2f}s via {c.extra.get('route') or 'router'}, "
            f"decode transfers {c.transfers_before} -> {c.transfers_after}: {c.text!r}",
            highlight=False,
        )
        check = c.extra.get("verification")
        if check:
            console.print(f"canary verified on node {check.get('node')}: {(check.get('verdict') or {}).get('summary')}", highlight=False)
    b = dep.plan.balancer
    if b is not None:  # the operator's one endpoint: the balancer in front of the routers (external: the operator's own)
        front = "the operator's balancer" if b.external else "HAProxy"
        console.print(f"[bold green]endpoint[/]: http://{b.address}:{b.port}/v1  (model {dep.topology.model.served_name!r}; "
                      f"{len(b.backends)} routers behind {front})")
    elif router is not None:
        console.print(f"[bold green]endpoint[/]: {probes.base_url(router)}/v1  (model {dep.topology.model.served_name!r})")


def down(
    topology: Optional[Path] = typer.Argument(None, help="Topology file; default: the embedded topology_examples/local.yaml."),
    limit: Optional[str] = typer.Option(None, "--limit", help="Only these hosts."),
    only: Optional[str] = typer.Option(None, "--only", help="Only this role."),
    purge_weights: bool = typer.Option(False, "--purge-weights", help="Also delete the converted weights on decode nodes."),
    check: bool = typer.Option(False, "--check", help="Show what would stop; stop nothing."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask before changing remote hosts."),
) -> None:
    """Stop every service `up` started (balancer -> routers -> prefill -> decode); keep weights unless --purge-weights."""
    from tilepd.deploy import deployment

    dep = _load(topology)
    if purge_weights:
        from tilepd.deploy.weights import purge_refusal

        m = dep.topology.model
        why = purge_refusal(m.weights_path, m.hf_path, sorted({h.base_dir for h in dep.plan.hosts}))
        if why:
            err.print(f"[red]down --purge-weights refused[/]: {why} (topology {dep.topology_path}); nothing was stopped or deleted",
                      highlight=False)
            raise typer.Exit(int(ExitCode.INVALID))
    remote = [h.name for h in dep.plan.hosts if not h.local]
    if remote and not yes and not check and not typer.confirm(f"Stop {dep.plan.deployment} on {', '.join(remote)}?", default=True):
        raise typer.Exit(int(ExitCode.OK))
    deployment.render(dep)
    result = _run_playbook(
        dep, "down.yml", title="tilepd down", limit=limit, only=only, check=check, extravars={"tilepd_purge_weights": purge_weights}
    )
    code = deployment.exit_code(result)
    if code != ExitCode.OK:
        _report_failures(result, dep)
        raise typer.Exit(int(code))
    console.print(f"stopped: {sum(1 for rs in result.service_results.values() for r in rs if r.get('action') == 'stop')} service(s)")


def status(
    topology: Optional[Path] = typer.Argument(None, help="Topology file; default: the embedded topology_examples/local.yaml."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    watch: Optional[float] = typer.Option(None, "--watch", help="Refresh every N seconds until interrupted."),
    wide: bool = typer.Option(False, "--wide", help="Every column: role, pid, full health message, all live figures, each "
                              "service's deployment fingerprint (its host reads the checkpoint), drift."),
) -> None:
    """One line per service: host, service, state, health, a live figure. Exit 0 all healthy, 7 degraded."""
    from tilepd.deploy import status as st

    dep = _load(topology)
    while True:
        rows = st.collect(dep.plan, known_hosts=dep.known_hosts, fingerprints=wide)
        healthy = all(r.ok for r in rows)
        if as_json:
            typer.echo(json.dumps({"deployment": dep.plan.deployment, "healthy": healthy, "services": st.as_json(rows)}, indent=2))
        else:
            if watch:
                console.clear()
            console.print(st.table(rows, wide=wide))
            console.print("[green]all healthy[/]" if healthy else "[red]degraded[/]" + ("" if wide else " (details: --wide or --json)") + st.runbook_hint(rows))
        if not watch:
            break
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            break
    raise typer.Exit(int(ExitCode.OK if healthy else ExitCode.UNHEALTHY))


def logs(
    topology: Optional[Path] = typer.Argument(None, help="Topology file; default: the embedded topology_examples/local.yaml."),
    role: Optional[str] = typer.Option(None, "--role", help="Only this role (decode, prefill, router, native_decode, convert, tiny_model)."),
    host: Optional[str] = typer.Option(None, "--host", help="Only this host (its address, as in `tilepd plan`)."),
    lines: int = typer.Option(50, "-n", "--lines", help="Lines per service."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines."),
) -> None:
    """Tail service logs from their hosts; each line is prefixed with host/service."""
    from tilepd.deploy import logs as lg

    dep = _load(topology)
    sources = lg.select(dep.plan, role=role, host=host)
    if not sources:
        err.print(f"[red]no service matches[/] role={role} host={host}; hosts: {', '.join(dep.host_names())}")
        raise typer.Exit(int(ExitCode.USAGE))
    if not follow:
        failed = lg.tail(dep.plan, sources, lines=lines, emit=lambda s: typer.echo(s), known_hosts=dep.known_hosts)
        raise typer.Exit(int(ExitCode.UNREACHABLE if failed == len(sources) else ExitCode.OK))
    try:
        for line in lg.follow(dep.plan, sources, lines=lines, known_hosts=dep.known_hosts):
            typer.echo(line)
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
    app.command("status")(status)
    app.command("logs")(logs)
