"""tilepd.plan: expand a Topology into the exact services each host runs, and render them to files.

Public API: `build_plan(topology) -> Plan`, `render_plan(plan, out_dir) -> list[Path]`.
"""

from tilepd.plan.builder import build_plan, topology_hash
from tilepd.plan.model import HostPlan, Plan, Service
from tilepd.plan.render import RenderError, render_plan

__all__ = ["HostPlan", "Plan", "RenderError", "Service", "build_plan", "render_plan", "topology_hash"]
