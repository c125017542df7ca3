"""What the playbooks need beyond the plan's own inventory: per-host service specs and files.

`render_plan` writes `inventory.yml` (connection settings, groups) and the per-host
files. This module adds `host_vars/<host>.yml` beside it, which Ansible merges in:
the interpreter, the model paths, and for every daemon the `ServiceSpec` that
`python -m tilepd.deploy.proc` runs, the rendered files to copy, and its env file.

Nothing here holds a secret: host_vars name the secret files a host needs (paths and the
operator's variable each comes from); their values reach the hosts at run time only
(tilepd.deploy.secrets, playbooks/roles/common/tasks/secrets.yml).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tilepd.deploy.balancer import BalancerSpec
from tilepd.deploy.canary import CanarySpec
from tilepd.deploy.proc import ServiceSpec
from tilepd.plan import HostPlan, Plan, Service
from tilepd.plan.ansible_yaml import ansible_yaml
from tilepd.plan.haproxy import FALL, RISE
from tilepd.deploy.service_user import Manifest, access_needs
from tilepd.plan.systemd import data_dir, env_file_text, secret_copies, secret_paths
from tilepd.topology import Topology, canonical_family

SYSTEMD_DIR = "/etc/systemd/system"
# rendered per-host entries that are not copied verbatim under <base_dir>
_NOT_COPIED = {"services.json", "units", "env"}


def spec_file(host: HostPlan, service: Service) -> str:
    return f"{host.base_dir}/run/{service.name}.spec.json"


def secret_files(service: Service) -> list[Path]:
    """Files a service reads a secret from at start (the supervisor restarts it when one changes)."""
    return [Path(p) for p in secret_paths(service)]


# distributions (besides tilepd) whose upgrade on a host restarts the service there on the next `up`
RESTART_ON_UPGRADE: dict[str, tuple[str, ...]] = {"prefill": ("vllm",), "native_decode": ("vllm",), "decode": ("torch",)}


def canary_spec(plan: Plan, service: Service) -> CanarySpec | None:
    """A decode node's canary (tilepd.deploy.canary): through the plan's prefill instances, to the node's control port."""
    cfg = service.config or {}
    prefills = [s.health.url.removesuffix("/health") for h in plan.hosts for s in h.services if s.role == "prefill" and s.health]
    if service.role != "decode" or not prefills or "ctrl_port" not in cfg:
        return None
    return CanarySpec(node=str(cfg["name"]), prefill_urls=prefills, model=str(cfg["served_model_name"]), ctrl_host=str(cfg["advertise_host"]),
                      ctrl_port=int(cfg["ctrl_port"]), kv_timeout_s=float(cfg.get("kv_timeout_s", 30.0)))


def balancer_spec(plan: Plan, service: Service) -> BalancerSpec | None:
    """A router's place behind the balancer (its rolling restart drains it there); None without a balancer."""
    b = plan.balancer
    server = next((x.name for x in b.backends if x.service == service.name), None) if b is not None else None
    if b is None or service.role != "router" or server is None:
        return None
    return BalancerSpec(stats_url=b.stats_url, backend=b.backend, server=server, check_interval_s=b.check_interval_s,
                        checks_to_mark=max(FALL, RISE), drain_timeout_s=b.drain_timeout_s)


def service_spec(plan: Plan, service: Service) -> ServiceSpec:
    return ServiceSpec(
        name=service.name,
        role=service.role,
        argv=service.argv,
        env=dict(service.env),
        secret_files=secret_files(service),
        packages=list(RESTART_ON_UPGRADE.get(service.role, ())),
        cwd=Path(service.cwd),
        log_file=Path(service.log_file),
        pid_file=Path(service.pid_file),
        config_hash=service.config_hash,
        health_url=service.health.url if service.health else None,
        health_timeout_s=service.health.timeout_s if service.health else 180.0,
        mode=plan.services_mode,
        unit=service.unit,
        unit_path=Path(SYSTEMD_DIR) / service.unit,
        canary=canary_spec(plan, service),
        balancer=balancer_spec(plan, service),
    )


HOST_DIRS = ("run", "logs", "config", "env")


def _rendered_files(host: HostPlan, render_dir: Path) -> list[dict[str, Any]]:
    """Rendered files of this host, with where they go (same relative path under base_dir)."""
    root = render_dir / "hosts" / host.name
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_dir() or rel.parts[0] in _NOT_COPIED:
            continue
        out.append({"path": f"{host.base_dir}/{rel.as_posix()}", "content": path.read_text(), "mode": "0644"})
    return out


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def convert_options(topo: Topology, host: HostPlan, convert: Service) -> dict[str, Any]:
    """dtype and TP of the conversion: the plan's argv when it says, else what the node computes in
    (float32 on a `cpu` node, bfloat16 on GPUs), as `tilepd convert-weights TOPOLOGY` does."""
    node_cpu = any(d.address == host.name and d.gpu.type.lower() == "cpu" for d in topo.decode)
    return {
        "dtype": _flag(convert.argv, "--dtype") or ("fp32" if node_cpu else "bf16"),
        "tp": int(_flag(convert.argv, "--tp") or topo.model.tensor_parallel.decode),
    }


def host_vars(plan: Plan, topo: Topology, host: HostPlan, render_dir: Path) -> dict[str, Any]:
    py = host.environments[0].python if host.environments else host.services[0].python
    files = _rendered_files(host, render_dir)
    services = []
    for svc in host.services:
        if svc.kind != "daemon":
            continue
        spec = service_spec(plan, svc)
        # process mode reads the spec; systemd mode reads the env file
        files.append({"path": spec_file(host, svc), "content": spec.model_dump_json(indent=2) + "\n", "mode": "0600"})
        if plan.services_mode == "systemd":
            files.append({"path": f"{host.base_dir}/env/{svc.name}.env", "content": env_file_text(spec.env), "mode": "0600"})
        services.append(
            {
                "name": svc.name,
                "role": svc.role,
                "unit": svc.unit,
                "unit_src": str(render_dir / "hosts" / host.name / "units" / svc.unit),
                "spec_file": spec_file(host, svc),
                "config_hash": spec.config_hash,
            }
        )
    oneshots = {s.role for s in host.services if s.kind == "oneshot"}
    convert = next((s for s in host.services if s.role == "convert"), None)
    m = topo.model
    return {
        "ansible_python_interpreter": py,
        "tilepd_python": py,
        "tilepd_version": plan.tilepd_version,
        "tilepd_install": host.environments[0].install if host.environments else "operator",
        "tilepd_bundle": {"dirs": [f"{host.base_dir}/{d}" for d in HOST_DIRS], "files": files},
        "tilepd_secret_files": [s.model_dump() for s in host.secrets],
        "tilepd_deployment_secret_file": next((s.path for s in host.secrets if s.name == "deployment"), ""),
        "tilepd_deploy_services": services,
        # the balancer's HAProxy binary (its play installs Debian's package when it is missing)
        "tilepd_haproxy": next((s.argv[0] for s in host.services if s.role == "balancer"), ""),
        # systemd mode (roles/service_user): the user the units run as, the one folder it owns, what it must be able to use
        "tilepd_service_user": plan.service_user,
        "tilepd_data_dir": data_dir(host.base_dir),
        "tilepd_service_user_access": Manifest(user=plan.service_user, needs=access_needs(host)).model_dump(mode="json"),
        "tilepd_secret_copies": [{"src": src, "dest": dest} for src, dest in dict.fromkeys(
            pair for svc in host.services if svc.kind == "daemon" for pair in secret_copies(svc))],
        "tilepd_model": {
            "hf_path": m.hf_path,
            "weights_path": m.weights_path,
            "family": canonical_family(m.family),
            "generate_tiny": m.generate_tiny if "tiny_model" in oneshots else None,
            "convert": convert is not None,
            **(convert_options(topo, host, convert) if convert is not None else {}),
        },
    }


def write_host_vars(plan: Plan, topo: Topology, render_dir: Path) -> list[Path]:
    """Write render_dir/host_vars/<host>.yml for every host (0600: they describe the hosts' layout, no secret).

    Every string is `!unsafe` (tilepd.plan.ansible_yaml): topology values reach the playbooks as data."""
    out_dir = render_dir / "host_vars"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for host in plan.hosts:
        text = ansible_yaml(host_vars(plan, topo, host, render_dir), "generated by tilepd up; do not edit")
        path = out_dir / f"{host.name}.yml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        written.append(path)
    return written
