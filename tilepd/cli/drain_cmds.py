"""`tilepd drain FILE NODE` / `tilepd undrain FILE NODE`: take a decode node out of leasing without dropping a request.

drain: the node finishes the request it serves and refuses new ones (the router goes to
another node and leases it no more after its next health check); the verb waits until
the node is idle, which is final while it drains, so it can then be stopped or upgraded.
undrain: the node takes requests again.

Exit codes (tilepd/contracts/exit_codes.py): 0 drained (idle) / undrained, 2 no such decode node,
3/4 the topology is invalid or unreadable, 4 no usable deployment secret (or the node
refused it), 5 the node or its host did not answer, 10 still busy when --timeout ran out
(the node stays draining). NODE is the topology entry name (`d0`) or the service name
(`decode-d0`). The node API key derives from the deployment secret, read from the node's
host (its secret file, over SSH for a remote host) or `$TILEPD_DEPLOYMENT_SECRET`.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from tilepd.contracts.exit_codes import ExitCode

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _find(dep: Any, node: str) -> tuple[Any, Any]:
    """(host plan, decode service) named `node`; exit 2 listing the decode nodes when none is."""
    decodes = [(h, s) for h in dep.plan.hosts for s in h.services if s.role == "decode"]
    for host, svc in decodes:
        if node in (svc.name, svc.name.removeprefix("decode-")):
            return host, svc
    names = ", ".join(s.name.removeprefix("decode-") for _, s in decodes) or "none"
    err.print(f"[red]no decode node {node!r} in {dep.topology_path}[/]; decode nodes: {names}", highlight=False)
    raise typer.Exit(int(ExitCode.USAGE))


def _secret(dep: Any, host: Any, svc: Any) -> bytes | None:
    """The deployment secret the node started with: its file on the node's host (read over SSH for a remote one)."""
    from tilepd.auth import MIN_SECRET_CHARS, SecretFileError
    from tilepd.deploy.drain import env_secret, secret_from

    path = (svc.config or {}).get("secret_file")
    if path is None:
        return None
    try:
        if host.local:
            return secret_from(Path(path))
        from tilepd.deploy.remote import HostShell, HostUnreachable

        shell = HostShell(host, known_hosts=dep.known_hosts)
        try:
            out = shell.run(["cat", str(path)])
        except HostUnreachable as exc:
            err.print(f"[red]{exc}[/]", highlight=False)
            raise typer.Exit(int(ExitCode.UNREACHABLE)) from None
        finally:
            shell.close()
        value = out.stdout.strip()
        if out.rc == 0 and len(value) >= MIN_SECRET_CHARS:
            return value.encode()
        return env_secret(f"secret_file {path} on {host.name}: {out.stderr.strip() or f'{len(value)} characters'}")
    except SecretFileError as exc:
        err.print(f"[red]cannot authenticate to decode node {svc.name} on {host.name}[/]: {exc}", highlight=False)
        raise typer.Exit(int(ExitCode.INPUT)) from None


def _fail(exc: Any) -> None:
    code = {"unreachable": ExitCode.UNREACHABLE, "unauthorized": ExitCode.INPUT}.get(exc.kind, ExitCode.ERROR)
    err.print(f"[red]{exc}[/]", highlight=False)
    raise typer.Exit(int(code))


def _target(topology: Path, node: str) -> tuple[str, str, bytes | None]:
    from tilepd.cli.deploy_cmds import _load
    from tilepd.deploy.probes import base_url

    dep = _load(topology)
    host, svc = _find(dep, node)
    url = base_url(svc)
    if url is None:
        err.print(f"[red]decode node {svc.name} has no health URL in the plan[/]", highlight=False)
        raise typer.Exit(int(ExitCode.ERROR))
    return svc.name, url, _secret(dep, host, svc)


def drain(
    topology: Path = typer.Argument(..., help="Topology file."),
    node: str = typer.Argument(..., help="Decode node: topology entry name (d0) or service name (decode-d0)."),
    timeout: float = typer.Option(300.0, "--timeout", min=0.0, help="Seconds to wait for the node's request to finish."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Stop new requests to a decode node and wait until its current one finished (exit 10 if still busy at --timeout)."""
    from tilepd.deploy.drain import DrainError, drain as drain_node

    name, url, secret = _target(topology, node)
    try:
        with console.status(f"draining {name}: waiting for its request to finish ...") if not as_json else nullcontext():
            result = drain_node(url, secret, timeout_s=timeout, node=name)
    except DrainError as exc:
        _fail(exc)
        return
    if as_json:
        typer.echo(json.dumps(result.as_json()))
    elif result.idle:
        console.print(f"[green]{name} drained[/]: idle after {result.waited_s:.1f}s; it takes no new request until "
                      f"`tilepd undrain {topology} {node}` or a restart", highlight=False)
    else:
        err.print(f"[yellow]{name} still busy after {result.waited_s:.1f}s[/] (state {result.state}, transfer "
                  f"{result.transfer_id}); it stays draining: run drain again to keep waiting, or undrain", highlight=False)
    raise typer.Exit(int(ExitCode.OK if result.idle else ExitCode.NOT_DRAINED))


def undrain(
    topology: Path = typer.Argument(..., help="Topology file."),
    node: str = typer.Argument(..., help="Decode node: topology entry name (d0) or service name (decode-d0)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Let a drained decode node take requests again (the router leases it after its next health check)."""
    from tilepd.deploy.drain import DrainError, undrain as undrain_node

    name, url, secret = _target(topology, node)
    try:
        result = undrain_node(url, secret, node=name)
    except DrainError as exc:
        _fail(exc)
        return
    if as_json:
        typer.echo(json.dumps(result.as_json()))
    else:
        console.print(f"[green]{name} undrained[/]: takes requests again", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("drain")(drain)
    app.command("undrain")(undrain)
