"""`tilepd convert-weights TOPOLOGY` on the decode nodes, through the same playbooks as `up`.

The verb lives in tilepd/cli/engine_cmds.py; it calls `convert_on_nodes`, which runs
`playbooks/convert.yml` (common + weights roles on the `decode` group): each node
converts its own copy, skipped where the converter's manifest already matches.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from tilepd.contracts.exit_codes import ExitCode


def convert_on_nodes(topology_path: Path | str, *, limit: str | None = None, check: bool = False, console: Console | None = None) -> int:
    """Convert weights on every decode node of the topology; returns a tilepd exit code (0, 3, 4, 5, 6)."""
    from tilepd.deploy import deployment
    from tilepd.deploy.progress import Progress, summary_table
    from tilepd.topology import TopologyError, TopologyFileError

    console = console or Console(soft_wrap=True)
    try:
        dep = deployment.load(Path(topology_path))
    except TopologyFileError as e:
        console.print(f"[red]{e}[/]")
        return int(ExitCode.INPUT)
    except TopologyError as e:
        console.print(f"[red]{topology_path}: invalid topology[/]\n{e}", highlight=False)
        return int(ExitCode.INVALID)
    deployment.render(dep)
    with Progress(console) as progress:
        result = deployment.run(dep, "convert.yml", limit=limit, check=check, on_event=progress)
    decode_hosts = [h.name for h in dep.plan.hosts if "decode" in h.roles]
    console.print(summary_table(result, decode_hosts, "tilepd convert-weights"))
    for f in result.failures:
        what = "unreachable" if f.unreachable else f"failed: {f.task}"
        console.print(f"[red]{f.host} {what}[/]\n  {f.message.strip()}", highlight=False)
    return int(deployment.exit_code(result))
