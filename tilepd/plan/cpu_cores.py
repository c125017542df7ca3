"""Disjoint cores for co-located CPU vLLM instances (`VLLM_CPU_OMP_THREADS_BIND`).

Why: on 'auto' vLLM's CPU platform binds every instance's worker to the same cores of
the NUMA node (on x86 the last logical CPU of each physical core), so two vllm-cpu
instances on one host (a prefill and a native decode) share one core; beside the
prefill's busy NIXL progress thread the native decode's worker got 3 s of CPU in
2 min and never finished starting (issue 13 part 8). Giving each instance (each TP
rank) its own cores removes that.

Only hosts whose cores the planner knows are bound: loopback hosts, with the cores
this process may run on (what `build_plan` is given, like `python: current`). A
service whose topology `env` sets the variable keeps the operator's value, and its
cores are left to it. When the host also runs tilepd services (decode nodes, router)
and has a core to spare, the first core is kept free of vLLM for them, and native
decodes get the last cores: on CPU, vLLM's NixlConnector pins its worker's main thread
to the last core of the NUMA node whatever the binding says (see
tilepd/connector/cpu_binding.py; our connector moves the prefill's back, nothing moves a
native decode's), so that core is best the native decode's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tilepd.contracts.cpu_bind import BIND_ENV, parse_cpu_list


@dataclass(frozen=True)
class CpuVllm:
    """One CPU vLLM service of a host: its name, TP ranks (one core list each) and the operator's env."""

    name: str
    ranks: int
    env: dict[str, str]


def _ranges(cores: Sequence[int]) -> str:
    """'0-3,6' for [0, 1, 2, 3, 6]."""
    parts: list[str] = []
    start = prev = cores[0]
    for c in (*cores[1:], None):
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def split_cores(cores: Sequence[int], services: Sequence[CpuVllm], *, other_services: bool) -> dict[str, str]:
    """Service name -> `VLLM_CPU_OMP_THREADS_BIND` value, for the services the operator did not bind.

    Nothing is bound when fewer than two CPU vLLM services share the host (vLLM's 'auto'
    is fine alone) or when the free cores cannot give every rank a core of its own.
    """
    if len(services) < 2:
        return {}
    free = sorted(set(cores))
    todo: list[CpuVllm] = []
    for s in services:
        own = s.env.get(BIND_ENV)
        if own is None:
            todo.append(s)
        else:
            free = [c for c in free if c not in (parse_cpu_list(own) or set())]
    ranks = sum(s.ranks for s in todo)
    if not todo or len(free) < ranks:
        return {}
    if other_services and len(free) > ranks:
        free = free[1:]  # the decode nodes' and router's core: not the last, where NIXL pins vLLM's worker threads
    # native decodes last: their worker's main thread is pinned to the last core by NixlConnector, which is then theirs
    todo.sort(key=lambda s: s.name.startswith("native-decode"))
    per = len(free) // ranks
    free = free[len(free) - per * ranks:]  # cores left over stay unbound at the front: the last core is a native decode's
    out: dict[str, str] = {}
    i = 0
    for s in todo:
        lists = []
        for _ in range(s.ranks):
            lists.append(_ranges(free[i:i + per]))
            i += per
        out[s.name] = "|".join(lists)
    return out
