"""The Ansible inventory the deploy step runs against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tilepd.plan.model import HOST_ROLES, Plan


def inventory(plan: Plan, render_dir: Path) -> dict[str, Any]:
    """`all.hosts` with connection settings and the host's services; `children` groups hosts by role."""
    hosts: dict[str, Any] = {}
    for h in plan.hosts:
        entry: dict[str, Any] = {"ansible_host": h.address, "ansible_connection": "local" if h.local else "ssh"}
        if not h.local:
            if h.ssh.user:
                entry["ansible_user"] = h.ssh.user
            entry["ansible_port"] = h.ssh.port
            if h.ssh.key_file:
                entry["ansible_ssh_private_key_file"] = h.ssh.key_file
        entry["tilepd_base_dir"] = h.base_dir
        entry["tilepd_host_dir"] = str(render_dir / "hosts" / h.name)
        entry["tilepd_services"] = [s.name for s in h.services]
        entry["tilepd_environments"] = [e.model_dump(mode="json") for e in h.environments]
        hosts[h.name] = entry
    children = {role: {"hosts": {h.name: {} for h in plan.hosts if role in h.roles}} for role in HOST_ROLES}
    return {
        "all": {
            "vars": {
                "tilepd_deployment": plan.deployment,
                "tilepd_base_dir": plan.base_dir,
                "tilepd_services_mode": plan.services_mode,
                "tilepd_topology_hash": plan.topology_hash,
                "tilepd_render_dir": str(render_dir),
            },
            "hosts": hosts,
            "children": {role: group for role, group in children.items() if group["hosts"]},
        }
    }
