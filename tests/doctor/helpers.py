"""Helpers of the doctor tests: recorded tool outputs and host expectations from the shipped examples."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tilepd.deploy.remote import Output
from tilepd.doctor.expect import GpuNeed, HostExpect, host_expectations
from tilepd.plan import build_plan
from tilepd.resources import examples_dir
from tilepd.topology import load_topology

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str, rc: int = 0) -> Output:
    """A recorded tool output (tests/doctor/fixtures/SOURCES.md says where each comes from) as a command's result."""
    return Output(rc, (FIXTURES / name).read_text(), "")


def seed_host(role: str) -> HostExpect:
    """The expectations `tilepd doctor` derives for the host of `role` in glm51-seed.yaml (8x B200, 4 NICs, nixl)."""
    topo = load_topology(examples_dir() / "glm51-seed.yaml")
    plan = build_plan(topo)
    return next(e for e in host_expectations(topo, plan) if role in e.host.roles)


def with_gpus(exp: HostExpect, count: int, gpu_type: str | None, free_fraction: float = 0.9) -> HostExpect:
    return replace(exp, gpus=[GpuNeed("d0", count, gpu_type, free_fraction)])


def with_nics(exp: HostExpect, *nics: str) -> HostExpect:
    return replace(exp, nics=list(nics))
