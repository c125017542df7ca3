"""What each host of a topology must offer: GPUs, NICs, ports, interpreters, weights.

Derived from the validated topology (GPU counts and types, NICs, memory utilisation) and the plan
(which interpreters, services, ports and base_dir land on which host), so doctor checks exactly
what `up` would need there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import ip_address

from tilepd.plan import HostPlan, Plan, Service
from tilepd.topology import Topology

VLLM_DEFAULT_GPU_UTIL = 0.9  # vLLM's --gpu-memory-utilization default


@dataclass
class GpuNeed:
    entry: str  # topology entry name
    count: int
    gpu_type: str | None
    free_fraction: float  # of each GPU's total memory that must be free at start


@dataclass
class HostExpect:
    host: HostPlan
    entries: list[str] = field(default_factory=list)
    gpus: list[GpuNeed] = field(default_factory=list)
    nics: list[str] = field(default_factory=list)
    binds: set[str] = field(default_factory=set)
    decode_weights: bool = False  # a decode node here loads the converted weights
    hf_needed: bool = False  # the HF checkpoint is read here (prefill, native, router tokenizer, conversion)

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)

    @property
    def daemons(self) -> list[Service]:
        return [s for s in self.host.services if s.kind == "daemon"]

    def ports(self) -> list[tuple[Service, str, int]]:
        return [(s, name, port) for s in self.daemons for name, port in sorted(s.ports.items())]


def _bind(entry) -> str:  # noqa: ANN001 - a topology host entry
    if entry.bind:
        return entry.bind
    try:
        return entry.address if ip_address(entry.address).is_loopback else "0.0.0.0"
    except ValueError:
        return "0.0.0.0"


def host_expectations(topo: Topology, plan: Plan) -> list[HostExpect]:
    """One HostExpect per plan host (by address), in plan order."""
    by_addr = {h.address: HostExpect(h) for h in plan.hosts}

    def at(entry) -> HostExpect:  # noqa: ANN001
        exp = by_addr[entry.address]
        exp.entries.append(entry.name)
        exp.binds.add(_bind(entry))
        for nic in entry.nics:
            if nic not in exp.nics:
                exp.nics.append(nic)
        return exp

    for p in [*topo.prefill, *topo.native_decode]:
        exp = at(p)
        exp.hf_needed = True
        if p.gpus:
            exp.gpus.append(GpuNeed(p.name, p.gpus, p.gpu_type, p.gpu_memory_utilization or VLLM_DEFAULT_GPU_UTIL))
    for d in topo.decode:
        exp = at(d)
        exp.decode_weights = exp.hf_needed = True
        if d.gpu.type.lower() != "cpu" and d.gpu.count:
            exp.gpus.append(GpuNeed(d.name, d.gpu.count, d.gpu.type, VLLM_DEFAULT_GPU_UTIL))
    for r in topo.all_routers:
        at(r).hf_needed = True
    if topo.balancer is not None and not topo.balancer.external:
        at(topo.balancer)
    return list(by_addr.values())
