"""build_plan: a validated Topology -> the exact services each host runs.

Pure: no I/O, no clock. The same topology (and the same `current_python` and local
cores) gives the same Plan byte for byte, so hashes can detect drift between what
was deployed and what the file now says.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import defaultdict
from typing import Any, Sequence

from pydantic_core import to_json

from tilepd import __version__
from tilepd.plan import vllm_args
from tilepd.plan.cpu_cores import CpuVllm, split_cores
from tilepd.plan.haproxy import HEALTH_PATH, STATS_PATH, haproxy_cfg
from tilepd.plan.model import (
    HOST_ROLES,
    STAGES,
    BalancerBackend,
    BalancerPlan,
    Health,
    HostPlan,
    Plan,
    PythonEnv,
    SecretFile,
    Service,
    SshTarget,
)
from tilepd.plan.systemd import data_dir
from tilepd.contracts.service_configs import (
    ConnectorExtraConfig,
    DecodeEndpoint,
    DecodeServerConfig,
    DivergenceWatchConfig,
    NativePoolConfig,
    RouterConfig,
    RoutingConfig,
    TransportConfig,
)
from tilepd.topology.families import canonical_family
from tilepd.topology.rules import CURRENT_PYTHON, is_cpu, is_loopback
from tilepd.topology.schema import DecodeNode, HostBase, Router, Topology

RDMA_TRANSPORTS = frozenset({"nixl", "mooncake"})
HEALTH_TIMEOUT_S = {"gpu": 1800.0, "cpu": 300.0, "router": 60.0, "balancer": 60.0}
BALANCER_BACKEND = "routers"  # HAProxy's backend of the routers



# the operator's variable that, when set, names the deployment secret `tilepd up` places (else kept or generated)
DEPLOYMENT_SECRET_ENV = "TILEPD_DEPLOYMENT_SECRET"


def sha256_json(value: Any) -> str:
    """Hash of compact JSON; key order is the (deterministic) order the plan builds, so no sorting."""
    return "sha256:" + hashlib.sha256(to_json(value)).hexdigest()


def topology_hash(topo: Topology) -> str:
    """Hash of the normalised topology (defaults filled in, key order and comments irrelevant)."""
    data = json.dumps(topo.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(data.encode()).hexdigest()


class _Planner:
    """Holds the per-topology facts every service builder needs."""

    def __init__(self, topo: Topology, current_python: str, local_cores: Sequence[int] = ()):
        self.topo = topo
        self.current_python = current_python
        self.base = topo.deployment.base_dir.rstrip("/") or "/"
        self.family = canonical_family(topo.model.family) or topo.model.family
        self.native = bool(topo.native_decode)
        self.endpoints = tuple(DecodeEndpoint(name=d.name, host=d.address, ctrl_port=d.ctrl_port, http_port=d.http_port) for d in topo.decode)
        self.services: dict[str, list[Service]] = defaultdict(list)
        self.roles: dict[str, list[str]] = defaultdict(list)
        self.entries: dict[str, list[HostBase]] = defaultdict(list)
        self.envs: dict[str, dict[str, PythonEnv]] = defaultdict(dict)
        self.secrets: dict[str, dict[str, SecretFile]] = defaultdict(dict)
        self.cpu_binds = self._cpu_binds(local_cores)

    def _cpu_binds(self, local_cores: Sequence[int]) -> dict[tuple[str, str], dict[str, str]]:
        """(address, service) -> {VLLM_CPU_OMP_THREADS_BIND: cores} for co-located CPU vLLM services (cpu_cores.py)."""
        t = self.topo
        by_host: dict[str, list[CpuVllm]] = defaultdict(list)
        for prefix, entries, tp in (("prefill", t.prefill, t.model.tensor_parallel.prefill),
                                    ("native-decode", t.native_decode, t.model.tensor_parallel.native_decode)):
            for e in entries:
                if e.gpus == 0 and is_loopback(e.address):
                    by_host[e.address].append(CpuVllm(f"{prefix}-{e.name}", tp, dict(e.env)))
        out: dict[tuple[str, str], dict[str, str]] = {}
        for address, services in by_host.items():
            others = any(d.address == address for d in t.decode) or any(r.address == address for r in t.all_routers)
            for name, cores in split_cores(local_cores, services, other_services=others).items():
                out[(address, name)] = {"VLLM_CPU_OMP_THREADS_BIND": cores}
        return out

    # --- helpers -------------------------------------------------------------

    def base_of(self, entry: HostBase) -> str:
        return (entry.base_dir or self.topo.deployment.base_dir).rstrip("/") or "/"

    def writable_dir(self, entry: HostBase) -> str:
        """Where a service writes its own state: in systemd mode the service user's data dir (the only place its unit
        may write), in process mode run/ beside the pid files (the SSH user owns the whole base dir)."""
        base = self.base_of(entry)
        return data_dir(base) if self.topo.deployment.services == "systemd" else f"{base}/run"

    def python(self, entry: HostBase) -> str:
        chosen = entry.python or self.topo.deployment.python
        if chosen == CURRENT_PYTHON:
            return self.current_python
        return chosen or f"{self.base_of(entry)}/venv/bin/python"

    def install(self, entry: HostBase) -> str:
        if (entry.python or self.topo.deployment.python) == CURRENT_PYTHON:
            return "operator"  # the running interpreter is already provisioned
        return entry.install or self.topo.deployment.install

    def bind(self, entry: HostBase) -> str:
        if entry.bind:
            return entry.bind
        return entry.address if is_loopback(entry.address) else "0.0.0.0"

    def ucx_devices(self, entry: HostBase) -> str | None:
        if self.topo.transport.ucx_net_devices:
            return self.topo.transport.ucx_net_devices
        if not entry.nics:
            return None
        return ",".join(n if ":" in n else f"{n}:1" for n in entry.nics)

    def transport_config(self, entry: HostBase, data_port: int | None = None) -> TransportConfig:
        t = self.topo.transport
        return TransportConfig(
            name=t.name,
            data_port=data_port if t.name == "tcp" else None,
            ucx_net_devices=self.ucx_devices(entry) if t.name == "nixl" else None,
            mooncake_protocol=t.mooncake_protocol,
            mooncake_devices=",".join(entry.nics) or None if t.name == "mooncake" else None,
        )

    def base_env(self, entry: HostBase) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1"}
        ucx = self.ucx_devices(entry)
        if self.topo.transport.name == "nixl" and ucx:
            env["UCX_NET_DEVICES"] = ucx
        return env

    def add_env(self, address: str, entry: HostBase, vllm: bool) -> None:
        py = self.python(entry)
        install = self.install(entry)
        old = self.envs[address].get(py)
        self.envs[address][py] = PythonEnv(python=py, install=install, vllm=vllm or bool(old and old.vllm))

    def add(
        self,
        address: str,
        entry: HostBase,
        *,
        name: str,
        role: str,
        argv: list[str],
        env: dict[str, str],
        health: Health | None = None,
        ports: dict[str, int] | None = None,
        config_file: str | None = None,
        config: dict[str, Any] | None = None,
        creates: str | None = None,
    ) -> None:
        env = {**env, **entry.env}  # the operator's env wins
        cwd = self.base_of(entry)
        self.services[address].append(
            Service(
                name=name,
                role=role,  # type: ignore[arg-type]
                kind="oneshot" if creates is not None else "daemon",
                stage=STAGES[role],
                creates=creates,
                argv=argv,
                env=env,
                cwd=cwd,
                health=health,
                ports=ports or {},
                python=self.python(entry),
                log_file=f"{cwd}/logs/{name}.log",
                pid_file=f"{cwd}/run/{name}.pid",
                unit=f"tilepd-{name}.service",
                config_file=config_file,
                config=config,
                config_hash=sha256_json({"argv": argv, "env": env, "cwd": cwd, "config": config, **self.runs_as()}),
            )
        )

    def runs_as(self) -> dict[str, str]:
        """The user a systemd unit runs as, hashed with its config: a new service_user restarts the units (process
        mode: {}, its hashes unchanged)."""
        return {"user": self.topo.deployment.service_user} if self.topo.deployment.services == "systemd" else {}

    def secret(self, entry: HostBase, name: str, source_env: str) -> str:
        """Where `name` lives on this entry's host (the deploy step writes it there, 0600)."""
        path = f"{self.base_of(entry)}/secrets/{name.replace('_', '-')}"
        self.secrets[entry.address][path] = SecretFile(name=name, path=path, source_env=source_env)  # type: ignore[arg-type]
        return path

    def note_host(self, entry: HostBase, role: str, vllm: bool = False) -> None:
        self.entries[entry.address].append(entry)
        if role not in self.roles[entry.address]:
            self.roles[entry.address].append(role)
        self.add_env(entry.address, entry, vllm)

    # --- services --------------------------------------------------------------

    def tiny_models(self) -> None:
        family = self.topo.model.generate_tiny
        if family is None:
            return
        hf = self.topo.model.hf_path
        for address, entries in self.entries.items():
            first = entries[0]
            argv = [self.python(first), "-m", "tilepd", "dev", "tiny-model", family, hf]
            self.add(address, first, name="tiny-model", role="tiny_model", argv=argv, env={"PYTHONUNBUFFERED": "1"}, creates=f"{hf}/config.json")

    def decode(self, node: DecodeNode) -> None:
        m = self.topo.model
        cpu = is_cpu(node)
        self.note_host(node, "decode")
        py = self.python(node)
        convert_argv = [py, "-m", "tilepd", "convert-weights", "--model-dir", m.hf_path, "--out", m.weights_path, "--family", self.family,
                        "--tp", str(m.tensor_parallel.decode)]  # per-rank shards for a TP decode node
        if not cpu:  # GPU nodes run the topology's weights dtype (rule memory-fit sizes them); cpu nodes fp32
            convert_argv += ["--dtype", m.weights_dtype]
        self.add(node.address, node, name=f"convert-{node.name}", role="convert", argv=convert_argv, env={"PYTHONUNBUFFERED": "1"}, creates=m.weights_path)
        name = f"decode-{node.name}"
        cfg = DecodeServerConfig(
            name=node.name,
            served_model_name=m.served_name,
            family=self.family,
            weights_dir=m.weights_path,
            max_seq_len=node.max_seq_len or m.max_seq_len,
            kv_cache_dtype=m.kv_cache_dtype.decode,
            device="cpu" if cpu else "cuda",
            tp_size=self.topo.model.tensor_parallel.decode,
            bind_host=self.bind(node),
            advertise_host=node.address,
            http_port=node.http_port,
            ctrl_port=node.ctrl_port,
            transport=self.transport_config(node, node.data_port),
            recv_buffer=node.recv_buffer or ("dram" if cpu else "vram"),
            num_speculative_tokens=m.speculative.decode.num_speculative_tokens if m.speculative.decode else 0,
            kv_timeout_s=node.kv_timeout_s,
            reservation_lease_s=node.reservation_lease_s,
            cuda_graphs=node.cuda_graphs and not cpu,
            allowed_senders=tuple(sorted({p.address for p in self.topo.prefill})),
            secret_file=self.secret(node, "deployment", DEPLOYMENT_SECRET_ENV),
            otlp_endpoint=self.topo.all_routers[0].otlp_endpoint,  # rule routers-agree: every router names the same
            drain_file=f"{self.writable_dir(node)}/{name}.drained",
        )
        config_file = f"{self.base_of(node)}/config/{name}.json"
        ports = {"http": node.http_port, "ctrl": node.ctrl_port}
        if self.topo.transport.name == "tcp":
            ports["data"] = node.data_port
        self.add(
            node.address,
            node,
            name=name,
            role="decode",
            argv=[py, "-m", "tilepd.runtime", "--config", config_file],
            env=self.base_env(node),
            health=Health(url=f"http://{node.address}:{node.http_port}/health", timeout_s=HEALTH_TIMEOUT_S["cpu" if cpu else "gpu"]),
            ports=ports,
            config_file=config_file,
            config=cfg.model_dump(mode="json"),
        )

    def prefill(self) -> None:
        t = self.topo
        tp = t.model.tensor_parallel.prefill
        for p in t.prefill:
            self.note_host(p, "prefill", vllm=True)
            extra = ConnectorExtraConfig(
                decode_allowlist=self.endpoints,
                transport=self.transport_config(p),
                model_family=self.family,
                max_seq_len=t.model.max_seq_len,
                otlp_endpoint=t.all_routers[0].otlp_endpoint,
            )
            kvt = vllm_args.prefill_kv_transfer_config(extra, self.native, cpu=p.gpus == 0)
            env = {**self.base_env(p), **self.cpu_binds.get((p.address, f"prefill-{p.name}"), {}),
                   **vllm_args.api_key_env(self.secret(p, "deployment", DEPLOYMENT_SECRET_ENV))}
            ports = {"http": p.port}
            if self.native:
                env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = p.address
                env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(p.nixl_side_channel_port)
                ports["nixl_side_channel"] = p.nixl_side_channel_port
            self.add(
                p.address,
                p,
                name=f"prefill-{p.name}",
                role="prefill",
                argv=vllm_args.vllm_argv(t, p, self.python(p), self.bind(p), tp, kvt),
                env=env,
                health=Health(url=f"http://{p.address}:{p.port}/health", timeout_s=HEALTH_TIMEOUT_S["gpu" if p.gpus else "cpu"]),
                ports=ports,
                config_file=f"{self.base_of(p)}/kv-transfer-config.json",
                config=kvt,
            )

    def native_decode(self) -> None:
        t = self.topo
        tp = t.model.tensor_parallel.native_decode
        for n in t.native_decode:
            self.note_host(n, "native_decode", vllm=True)
            kvt = vllm_args.nixl_config("kv_consumer", cpu=n.gpus == 0)
            name = f"native-decode-{n.name}"
            env = {**self.base_env(n), **self.cpu_binds.get((n.address, name), {}),
                   **vllm_args.api_key_env(self.secret(n, "deployment", DEPLOYMENT_SECRET_ENV))}
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = n.address
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(n.nixl_side_channel_port)
            self.add(
                n.address,
                n,
                name=name,
                role="native_decode",
                argv=vllm_args.vllm_argv(t, n, self.python(n), self.bind(n), tp, kvt),
                env=env,
                health=Health(url=f"http://{n.address}:{n.port}/health", timeout_s=HEALTH_TIMEOUT_S["gpu" if n.gpus else "cpu"]),
                ports={"http": n.port, "nixl_side_channel": n.nixl_side_channel_port},
                config_file=f"{self.base_of(n)}/config/{name}.json",
                config=kvt,
            )

    def routers(self) -> None:
        """One service per router: `router` for the single `router:` form, `router-<name>` for each of `routers:`."""
        t = self.topo
        for r in t.all_routers:
            self.router(r, "router" if t.router is not None else f"router-{r.name}")

    def router(self, r: Router, name: str) -> None:
        t = self.topo
        self.note_host(r, "router")
        prefill_urls = tuple(f"http://{p.address}:{p.port}" for p in t.prefill)
        native = None
        if self.native:
            native = NativePoolConfig(prefill_urls=prefill_urls, decode_urls=tuple(f"http://{n.address}:{n.port}" for n in t.native_decode))
        cfg = RouterConfig(
            name=r.name,
            bind_host=self.bind(r),
            port=r.port,
            served_model_name=t.model.served_name,
            tokenizer_dir=t.model.hf_path,
            prefill_urls=prefill_urls,
            decode_nodes=self.endpoints,
            native_pool=native,
            routing=RoutingConfig(
                default_pool=r.routing.default_pool,
                header=r.routing.header,
                by_model=dict(r.routing.by_model),
                fallback_to_native=r.routing.fallback_to_native and self.native,
            ),
            queue_timeout_s=r.queue_timeout_s,
            request_timeout_s=r.request_timeout_s,
            # a key from the operator's environment is written to a file on the router host at `up` (never into the
            # router's own environment, where `ps e` and /proc/PID/environ would show it)
            api_key_file=(self.secret(r, "router_api_key", r.api_key.env) if r.api_key.env else r.api_key.file) if r.api_key else None,
            secret_file=self.secret(r, "deployment", DEPLOYMENT_SECRET_ENV),
            tool_call_parser=tool_call_parser(t),
            otlp_endpoint=r.otlp_endpoint,
            divergence_watch=DivergenceWatchConfig(**r.divergence_watch.model_dump()),
        )
        config_file = f"{self.base_of(r)}/config/{name}.json"
        self.add(
            r.address,
            r,
            name=name,
            role="router",
            argv=[self.python(r), "-m", "tilepd.router", "--config", config_file],
            env={"PYTHONUNBUFFERED": "1"},
            health=Health(url=f"http://{r.address}:{r.port}/health", timeout_s=HEALTH_TIMEOUT_S["router"]),
            ports={"http": r.port},
            config_file=config_file,
            config=cfg.model_dump(mode="json"),
        )

    def balancer_plan(self) -> BalancerPlan | None:
        t = self.topo
        b = t.balancer
        if b is None:
            return None
        names = [("router" if t.router is not None else f"router-{r.name}", r) for r in t.all_routers]
        return BalancerPlan(
            name=b.name, address=b.address, port=b.port, external=b.external,
            stats_port=None if b.external else b.stats_port,
            stats_url=None if b.external else f"http://{b.address}:{b.stats_port}{STATS_PATH}", backend=BALANCER_BACKEND,
            check_interval_s=b.check_interval_s, drain_timeout_s=b.drain_timeout_s,
            request_timeout_s=max(r.request_timeout_s for r in t.all_routers),
            backends=[BalancerBackend(name=r.name, service=name, address=r.address, port=r.port) for name, r in names],
        )

    def balancer(self, plan: BalancerPlan | None) -> None:
        """HAProxy in front of the routers, started after them (an external balancer gets no service)."""
        b = self.topo.balancer
        if b is None or plan is None or plan.external:
            return
        self.note_host(b, "balancer")
        config_file = f"{self.base_of(b)}/config/balancer.cfg"
        ports = {"http": b.port, "stats": b.stats_port}
        self.add(
            b.address,
            b,
            name="balancer",
            role="balancer",
            argv=[b.haproxy, "-db", "-f", config_file],
            env={},
            health=Health(url=f"http://{b.address}:{b.port}{HEALTH_PATH}", timeout_s=HEALTH_TIMEOUT_S["balancer"]),
            ports=ports,
            config_file=config_file,
            config={"text": haproxy_cfg(plan, self.topo.deployment.name, self.bind(b))},
        )

    def hosts(self) -> list[HostPlan]:
        out = []
        for address in sorted(self.services):
            first = self.entries[address][0]
            roles = [r for r in HOST_ROLES if r in self.roles[address]]
            services = sorted(self.services[address], key=lambda s: s.stage)  # stable: keeps insertion order within a stage
            out.append(
                HostPlan(
                    name=address,
                    address=address,
                    local=is_loopback(address),
                    ssh=SshTarget(user=first.ssh.user, port=first.ssh.port, key_file=first.ssh.key_file),
                    base_dir=self.base_of(first),
                    roles=roles,  # type: ignore[arg-type]
                    environments=list(self.envs[address].values()),
                    services=services,
                    secrets=list(self.secrets[address].values()),
                )
            )
        return out


def tool_call_parser(topo: Topology) -> str | None:
    """The router parses tool calls with the parser the deployment gives vLLM: `--tool-call-parser NAME` in a prefill's
    or native decode's extra_args (the first named; with --enable-auto-tool-choice, as vLLM needs it for "auto")."""
    for entry in (*topo.prefill, *topo.native_decode):
        args = list(entry.extra_args)
        for j, arg in enumerate(args):
            if arg == "--tool-call-parser" and j + 1 < len(args):
                return args[j + 1]
            if arg.startswith("--tool-call-parser="):
                return arg.split("=", 1)[1]
    return None


def build_plan(topo: Topology, current_python: str | None = None, local_cores: Sequence[int] | None = None) -> Plan:
    """Expand a validated topology into per-host services (argv + env + cwd + config).

    `current_python` is what `python: current` resolves to (default: this interpreter);
    `local_cores` the cores of loopback hosts, split between their CPU vLLM services
    (default: the cores this process may run on).
    """
    cores = sorted(os.sched_getaffinity(0)) if local_cores is None else list(local_cores)
    p = _Planner(topo, current_python or sys.executable, cores)
    for node in topo.decode:
        p.decode(node)
    p.native_decode()
    p.prefill()
    p.routers()
    balancer = p.balancer_plan()
    p.balancer(balancer)
    p.tiny_models()
    return Plan(
        deployment=topo.deployment.name,
        topology_hash=topology_hash(topo),
        tilepd_version=__version__,
        services_mode=topo.deployment.services,
        service_user=topo.deployment.service_user,
        base_dir=p.base,
        transport=topo.transport.name,
        rdma=topo.transport.name in RDMA_TRANSPORTS,
        hosts=p.hosts(),
        balancer=balancer,
    )
