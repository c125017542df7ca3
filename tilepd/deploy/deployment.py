"""A deployment on the controller: topology -> plan -> rendered folder -> playbook runs.

The per-deployment folder (`$TILEPD_HOME/<deployment>`, default `~/.tilepd/<deployment>`)
holds the render (`rendered/`: plan, inventory, per-host files, host_vars) and
ansible-runner's private data (`runner/`). It is rewritten by every verb, so it
always matches the topology file that was given.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tilepd.contracts.exit_codes import ExitCode
from tilepd.deploy.inventory import write_host_vars
from tilepd.deploy.runner import PlaybookResult, TaskEvent, run_playbook
from tilepd.deploy.secrets import values_for
from tilepd.plan import Plan, build_plan
from tilepd.plan.render import render_plan
from tilepd.topology import Topology, load_topology

ROLES = ("decode", "native_decode", "prefill", "router", "balancer", "weights")


def state_home() -> Path:
    return Path(os.environ.get("TILEPD_HOME") or Path.home() / ".tilepd")


@dataclass
class Deployment:
    topology_path: Path
    topology: Topology
    plan: Plan
    state_dir: Path

    @property
    def render_dir(self) -> Path:
        return self.state_dir / "rendered"

    @property
    def known_hosts(self) -> Path:
        """SSH host keys of this deployment's hosts (ansible and `tilepd status` share it)."""
        return self.state_dir / "known_hosts"

    @property
    def inventory(self) -> Path:
        return self.render_dir / "inventory.yml"

    def host_names(self) -> list[str]:
        return [h.name for h in self.plan.hosts]


def load(topology_path: Path, *, state_dir: Path | None = None) -> Deployment:
    """Validate and plan (raises TopologyError / TopologyFileError); nothing is written."""
    topo = load_topology(topology_path)
    plan = build_plan(topo)
    return Deployment(Path(topology_path), topo, plan, state_dir or state_home() / plan.deployment)


def render(dep: Deployment) -> None:
    """Write the render and the host_vars the playbooks read."""
    render_plan(dep.plan, dep.render_dir)
    write_host_vars(dep.plan, dep.topology, dep.render_dir)


def resolve_limit(dep: Deployment, limit: str | None) -> str | None:
    """`--limit` takes an inventory host (an address) or a topology entry name (e.g. decode-0)."""
    if limit is None:
        return None
    names = set(dep.host_names())
    out = []
    for part in limit.split(","):
        if part in names:
            out.append(part)
            continue
        entry = _entry_address(dep.topology, part)
        if entry is None:
            raise ValueError(f"--limit {part!r}: no such host; hosts are {', '.join(sorted(names))} (or their topology entry names)")
        out.append(entry)
    return ",".join(out)


def _entry_address(topo: Topology, name: str) -> str | None:
    entries = [*topo.prefill, *topo.decode, *topo.native_decode, *topo.all_routers, *([topo.balancer] if topo.balancer else [])]
    for e in entries:
        if e.name == name:
            return e.address
    return None


def run(
    dep: Deployment,
    playbook: str,
    *,
    limit: str | None = None,
    only: str | None = None,
    check: bool = False,
    extravars: dict | None = None,
    on_event: Callable[[TaskEvent], None] | None = None,
) -> PlaybookResult:
    if only is not None and only not in ROLES:
        raise ValueError(f"--only {only!r}: choose one of {', '.join(ROLES)}")
    extravars = dict(extravars or {})
    # up places the secrets; their values are served to the playbook in memory (raises when one is missing)
    secrets = values_for(dep.plan) if playbook == "up.yml" else None
    if only is not None:
        extravars["tilepd_target"] = "decode" if only == "weights" else only
    return run_playbook(
        playbook,
        inventory=dep.inventory,
        private_dir=dep.state_dir / "runner",
        extravars=extravars,
        limit=resolve_limit(dep, limit),
        tags=only,
        check=check,
        on_event=on_event,
        known_hosts=dep.known_hosts,
        secret_env=secret_env_names(dep.plan),
        secrets=secrets,
    )


def secret_env_names(plan: Plan) -> tuple[str, ...]:
    """Operator environment variables that hold secrets (the router's API key, the deployment secret):
    kept out of ansible-playbook's environment, which ansible-runner writes to its artifacts."""
    return tuple(sorted({s.source_env for h in plan.hosts for s in h.secrets}))


def exit_code(result: PlaybookResult) -> ExitCode:
    """5 unreachable, 7 a health gate failed, 6 any other failure, else 0."""
    if result.unreachable:
        return ExitCode.UNREACHABLE
    if any(f.health for f in result.failures):
        return ExitCode.UNHEALTHY
    if result.failures or result.status != "successful":
        return ExitCode.TASK_FAILED
    return ExitCode.OK
