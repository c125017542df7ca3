"""The Plan: what each host runs, exactly (see docs/INTERFACES.md §5).

Plain data, no behaviour: `build_plan` fills it, `render_plan` writes it out, the
deploy step executes it. Key order is part of the contract (`plan --json` is stable).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Role = Literal["tiny_model", "convert", "decode", "native_decode", "prefill", "router", "balancer"]
HostRole = Literal["prefill", "decode", "native_decode", "router", "balancer"]

PLAN_API_VERSION = "tilepd/v1"
HOST_ROLES: tuple[str, ...] = ("prefill", "decode", "native_decode", "router", "balancer")

# start order: a stage starts only once the previous one is done (oneshots) or healthy (daemons)
STAGES: dict[str, int] = {"tiny_model": 0, "convert": 1, "decode": 2, "native_decode": 2, "prefill": 3, "router": 4, "balancer": 5}


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Health(_Data):
    url: str
    timeout_s: float


class SshTarget(_Data):
    user: str | None = None
    port: int = 22
    key_file: str | None = None


class PythonEnv(_Data):
    """An interpreter a host needs: who provides it and whether vLLM must be in it."""

    python: str
    install: Literal["playbook", "operator"]
    vllm: bool


class Service(_Data):
    name: str
    role: Role
    kind: Literal["oneshot", "daemon"]
    stage: int
    creates: str | None
    argv: list[str]
    env: dict[str, str]
    cwd: str
    health: Health | None
    ports: dict[str, int]
    python: str
    log_file: str
    pid_file: str
    unit: str
    config_file: str | None
    config: dict[str, Any] | None
    config_hash: str


class SecretFile(_Data):
    """A secret the deploy step writes on a host (mode 0600) at run time; its value is never in the plan.

    `deployment`: the deployment secret (tilepd.auth) — the hosts' existing one is kept, else
    `$TILEPD_DEPLOYMENT_SECRET` or a fresh one; `router_api_key`: the router's API key, read from the
    operator's environment variable `source_env` when `tilepd up` runs.
    """

    name: Literal["deployment", "router_api_key"]
    path: str
    source_env: str


class HostPlan(_Data):
    name: str
    address: str
    local: bool
    ssh: SshTarget
    base_dir: str  # this host's base_dir (the deployment's unless the topology overrides it)
    roles: list[HostRole]
    environments: list[PythonEnv]
    services: list[Service]
    secrets: list[SecretFile] = []


class BalancerBackend(_Data):
    """One router behind the balancer: its HAProxy server name (the router's topology name) and where it listens."""

    name: str
    service: str
    address: str
    port: int


class BalancerPlan(_Data):
    """The load balancer in front of the routers (tilepd/plan/haproxy.py renders its HAProxy configuration)."""

    name: str
    address: str
    port: int
    external: bool  # an operator-run balancer: no service, its backend list is rendered instead
    stats_port: int | None  # HAProxy's read-only stats page; None when external
    stats_url: str | None  # that page (`;csv` appended: each router's state)
    backend: str  # HAProxy's backend of the routers
    check_interval_s: float
    drain_timeout_s: float
    request_timeout_s: float  # the longest a request through it may take (the routers' request_timeout_s)
    backends: list[BalancerBackend]


class Plan(_Data):
    api_version: str = PLAN_API_VERSION
    deployment: str
    topology_hash: str
    tilepd_version: str
    services_mode: Literal["systemd", "process"]
    service_user: str  # systemd mode: every unit's User= and Group= (process mode runs services as the SSH user)
    base_dir: str
    transport: Literal["nixl", "mooncake", "tcp"]
    rdma: bool
    hosts: list[HostPlan]
    balancer: BalancerPlan | None = None

    def host(self, name: str) -> HostPlan:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def service(self, name: str, host: str | None = None) -> Service:
        """The service called `name` (on `host` when several hosts have one of that name)."""
        for h in self.hosts:
            if host is not None and h.name != host:
                continue
            for s in h.services:
                if s.name == name:
                    return s
        raise KeyError(name)
