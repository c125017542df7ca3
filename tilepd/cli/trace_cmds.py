"""`tilepd trace REQUEST_ID [TOPOLOGY] [--logs DIR] [--json]`: one request's timeline, from the services' logs.

Reads the router's per-request line (by request id: the `x-request-id` every response carries), then the decode
nodes' `event=decode_done` lines and the connector's lines in the prefill (vLLM) logs of the transfers it names
(tilepd/deploy/trace.py). Sources: `--logs DIR` (a folder of log files: `*.log` and rotations, e.g. a copy of
`<base_dir>/logs`, or a test stack's work folder), else the deployment of TOPOLOGY (default: the embedded
local.yaml), read on its hosts as `tilepd logs` does.

Exit codes (tilepd/contracts/exit_codes.py): 0 found (printed), 11 no router line names the request (or its final line is
not written yet), 4 `--logs` is not a readable folder, 3/4 the topology is invalid or unreadable, 5 every host that
holds a router log was unreachable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from tilepd.contracts.exit_codes import ExitCode

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

NODE_PHASES = ("kv_wait", "node_queue", "convert", "inject", "decode")


def trace(
    request_id: str = typer.Argument(..., help="The request id (the `x-request-id` response header)."),
    topology: Optional[Path] = typer.Argument(None, help="Topology file; default: the embedded topology_examples/local.yaml."),
    logs: Optional[Path] = typer.Option(None, "--logs", help="Read the log files in this folder instead of the deployment's hosts."),
    as_json: bool = typer.Option(False, "--json", help="Print the timeline as JSON."),
) -> None:
    """Print one request's timeline (every phase, node and connector details, fallback and retries) from the services' logs."""
    from tilepd.deploy import trace as tr_mod

    problems: list[str] = []
    if logs is not None:
        if not logs.is_dir():
            err.print(f"[red]--logs {logs}: not a folder[/]")
            raise typer.Exit(int(ExitCode.INPUT))
        tr = tr_mod.trace_folder(request_id, logs)
        where = str(logs)
    else:
        from tilepd.cli.deploy_cmds import _load

        dep = _load(topology)
        tr, problems = tr_mod.trace_plan(request_id, dep.plan, known_hosts=dep.known_hosts)
        where = f"deployment {dep.plan.deployment}"
    for p in problems:
        err.print(f"[yellow]{p}[/]")
    if not tr.found:
        if as_json:
            typer.echo(json.dumps(tr.to_json(), indent=2))
        seen = f"; {len(tr.events)} other line(s) name it: {', '.join(e for _, e, _ in tr.events)}" if tr.events else ""
        err.print(f"[red]request {request_id}: no final router line (event=done/refused/...) in {where}{seen}[/]")
        unreachable = problems and all("unreachable" in p for p in problems)
        raise typer.Exit(int(ExitCode.UNREACHABLE if unreachable and not tr.events else ExitCode.NOT_FOUND))
    if as_json:
        typer.echo(json.dumps(tr.to_json(), indent=2))
        raise typer.Exit(int(ExitCode.OK))
    _print(tr.to_json())
    raise typer.Exit(int(ExitCode.OK))


def _ms(v: Any) -> str:
    return "-" if v is None else f"{float(v):.1f}"


def _print(t: dict[str, Any]) -> None:
    head = (f"[bold]{t['request_id']}[/]  event={t['event']} route={t['route']} reason={t['reason']} status={t['status']} "
            f"outcome={t['outcome'] or '-'} node={t['node'] or '-'}")
    console.print(head, highlight=False)
    extra = []
    if t.get("fallback"):
        extra.append(f"[yellow]fallback: {t['fallback']}[/]")
    if t.get("retries"):
        extra.append(f"[yellow]retries: {t['retries']}[/]")
    if t.get("failovers") not in (None, "0"):
        extra.append(f"failovers={t['failovers']}")
    if t.get("trace_id"):
        extra.append(f"trace_id={t['trace_id']}")
    if extra:
        console.print("  ".join(extra), highlight=False)
    total = t.get("total_ms") or sum(v for v in t["phases_ms"].values())
    node = t["nodes"][-1] if t["nodes"] else {}
    table = Table(title=f"timeline ({_ms(total)} ms; ttft {_ms(t.get('ttft_ms'))} ms)", title_justify="left")
    table.add_column("phase")
    table.add_column("ms", justify="right")
    table.add_column("%", justify="right")
    table.add_column("clock")
    table.add_column("notes")
    for name, ms in t["phases_ms"].items():
        notes = ""
        if name == "decode" and node.get("tokens") is not None:
            notes = f"{int(node['tokens'])} tokens, {_ms(node.get('tokens_per_s'))} tokens/s"
        elif name == "prefill" and t["connector"]:
            c = t["connector"][-1]
            notes = f"connector staged in {_ms(c.get('staged.extract_total_ms', c.get('extract_total_ms')))} ms (window {_ms(c.get('staged.window_ms'))})"
        elif name == "failed_attempt" and t.get("retries"):
            notes = f"node:cause {t['retries']}"
        elif name == "other":
            notes = "time no phase covered"
        elif name == "relay":
            notes = "HTTP to/from the node, detokenise, write to the client"
        table.add_row(name, _ms(ms), f"{100 * ms / total:.1f}" if total else "-", "node" if name in NODE_PHASES else "router", notes)
    table.add_row("[bold]total[/]", _ms(total), "100.0", "router", "")
    console.print(table)
    if t["connector"] or t["nodes"]:
        det = Table(title="per transfer (overlapping the phases above)", title_justify="left")
        for col in ("transfer", "staging ms", "queued ms", "wire ms (connector)", "transfer ms (node)", "send total ms", "node log", "finish"):
            det.add_column(col)
        for tid in t["transfers"] or [n["transfer_id"] for n in t["nodes"]]:
            c = next((x for x in t["connector"] if x["transfer_id"] == tid), {})
            n = next((x for x in t["nodes"] if x["transfer_id"] == tid), {})
            det.add_row(tid, _ms(c.get("staged.extract_total_ms", c.get("extract_total_ms"))), _ms(c.get("queued_ms")), _ms(c.get("wire_ms")),
                        _ms(n.get("transfer")), _ms(c.get("total_ms")), n.get("source", c.get("source", "-")) or "-", n.get("finish") or "-")
        console.print(det)
    others = [e for e in t["events"] if e["event"] not in ("done", "lease_returned")]
    if others:
        console.print("events:", highlight=False)
        for e in others:
            rest = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("source", "event", "req", "timeline"))
            console.print(f"  {e['source']}: {e['event']} {rest[:300]}", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("trace")(trace)
