"""GPU and RDMA checks: the commands they run and pure evaluators of the tools' output.

Evaluators take the tools' text (as recorded in tests/doctor/fixtures/) and the host's
expectations, so every verdict is tested without the hardware; `run_*` only executes.
"""

from __future__ import annotations

from tilepd.deploy.remote import Output
from tilepd.doctor import parsers as P
from tilepd.doctor.expect import HostExpect
from tilepd.doctor.probe import Probe, first_line, missing_tool
from tilepd.doctor.result import Finding, ok, skip
from tilepd.topology.gpus import GIB, known_gpu

NVIDIA_SMI = "nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,memory.free --format=csv,noheader,nounits"
# torch/vLLM CUDA 12.8 wheels need driver >= 570.26 on Linux (CUDA 12.8 release notes, Table 3: toolkit driver versions)
MIN_DRIVER = (570, 26)
KV_RUNBOOK = "RB-kv-timeout"  # broken RDMA shows up as KV transfers that never land


def _type_matches(wanted: str, seen: str) -> bool:
    a, b = known_gpu(wanted), known_gpu(seen)
    if a is not None and b is not None:
        return a == b
    norm = lambda s: "".join(ch for ch in s.upper().removeprefix("NVIDIA ") if ch.isalnum())  # noqa: E731
    return norm(wanted) in norm(seen)


def evaluate_gpus(exp: HostExpect, smi: Output | None) -> list[Finding]:
    """gpu-count, gpu-type, gpu-driver, gpu-free-memory from `nvidia-smi` CSV (None: not run)."""
    h = exp.host.name
    if exp.gpu_count == 0:
        return [skip("gpu-count", h, "the topology puts no GPU on this host (CPU roles)")]
    need = ", ".join(f"{g.entry}: {g.count}x {g.gpu_type or 'any'}" for g in exp.gpus)
    if smi is None or missing_tool(smi):
        return [Finding("gpu-count", h, "fail", f"nvidia-smi not found; the topology needs {need}",
                        "install the NVIDIA driver (it ships nvidia-smi) and check `nvidia-smi` lists the GPUs")]
    gpus = P.nvidia_smi_gpus(smi.stdout)
    if smi.rc != 0 or not gpus:
        return [Finding("gpu-count", h, "fail", f"nvidia-smi exit {smi.rc}: {first_line(smi.stderr or smi.stdout) or 'no GPU listed'}",
                        "the driver does not answer: check `dmesg | grep -i nvrm`, reload the driver or reboot the host")]
    out = []
    verdict = "ok" if len(gpus) >= exp.gpu_count else "fail"
    out.append(Finding("gpu-count", h, verdict, f"{len(gpus)} GPU(s) seen; the topology needs {exp.gpu_count} ({need})",
                       "" if verdict == "ok" else "lower the GPU counts of the entries on this host, or fix the missing GPUs (`nvidia-smi -L`, `dmesg`)"))
    names = sorted({g.name for g in gpus})
    for need_t in {g.gpu_type for g in exp.gpus if g.gpu_type}:
        good = all(_type_matches(need_t, g.name) for g in gpus)
        out.append(Finding("gpu-type", h, "ok" if good else "fail", f"topology: {need_t}; nvidia-smi: {', '.join(names)}",
                           "" if good else "set gpu.type / gpu_type to the model nvidia-smi reports (rule memory-fit sizes by it)"))
    drivers = sorted({g.driver for g in gpus})
    dv = P.driver_tuple(drivers[0])
    if dv is None:
        out.append(Finding("gpu-driver", h, "warn", f"driver version {drivers[0]!r} not understood", required=False))
    elif dv[:2] < MIN_DRIVER:
        out.append(Finding("gpu-driver", h, "fail", f"driver {drivers[0]} < {'.'.join(map(str, MIN_DRIVER))}",
                           "CUDA 12.8 builds of torch/vLLM need driver >= 570.26: upgrade the NVIDIA driver"))
    else:
        out.append(ok("gpu-driver", h, f"driver {', '.join(drivers)}"))
    frac = max(g.free_fraction for g in exp.gpus)
    short = [g for g in gpus if g.total_bytes and g.free_bytes is not None and g.free_bytes < frac * g.total_bytes]
    if short:
        ev = "; ".join(f"GPU {g.index}: {g.free_bytes / GIB:.1f} of {g.total_bytes / GIB:.1f} GiB free" for g in short)  # type: ignore[operator]
        out.append(Finding("gpu-free-memory", h, "fail", f"{ev}; {frac:.0%} of each GPU must be free at start",
                           "see what holds it: `nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv`; "
                           "stop leftovers (runbook), or lower gpu_memory_utilization", runbook="RB-orphaned-ports"))
    else:
        out.append(ok("gpu-free-memory", h, f"{len(gpus)} GPU(s) with >= {frac:.0%} free"))
    return out


def run_gpus(probe: Probe, exp: HostExpect) -> list[Finding]:
    return evaluate_gpus(exp, probe.sh(NVIDIA_SMI) if exp.gpu_count else None)


def evaluate_rdma(exp: HostExpect, devices: Output, devinfo: Output, states: Output, gids: Output) -> list[Finding]:
    """rdma-devices, rdma-port-active, rdma-gid for the NICs the topology names on this host.

    `devices`: `ibv_devices`, or when that tool is absent (exit 127) the output of
    `ls -1 /sys/class/infiniband`; `devinfo`: `ibv_devinfo`; `states`:
    `grep -H . /sys/class/infiniband/*/ports/*/state` (used when ibv_devinfo is absent);
    `gids`: `grep -H . /sys/class/infiniband/*/ports/*/gids/[0-3]`.
    """
    h = exp.host.name
    if not exp.nics:
        return [Finding("rdma-devices", h, "warn", "the transport uses RDMA but this host's entries name no `nics`",
                        "list the RDMA NICs (e.g. mlx5_0) under `nics:` so UCX/Mooncake use the right ports", KV_RUNBOOK, required=False)]
    if missing_tool(devices):
        seen = [line.strip() for line in devices.stdout.splitlines() if line.strip()]
    else:
        seen = P.ibv_devices(devices.stdout)
    absent = [n for n in exp.nics if n not in seen]
    out = [Finding("rdma-devices", h, "fail" if absent else "ok",
                   f"topology: {', '.join(exp.nics)}; host: {', '.join(seen) or 'no RDMA device'}",
                   f"{', '.join(absent)} not present: load the driver (`modprobe mlx5_ib`), check `ibv_devices`, or fix `nics`" if absent else "",
                   KV_RUNBOOK if absent else None)]
    if not missing_tool(devinfo) and devinfo.rc == 0:
        ports = {d: {n: p.state for n, p in dev.ports.items()} for d, dev in P.ibv_devinfo(devinfo.stdout).items()}
        source = "ibv_devinfo"
    else:
        ports = P.sysfs_port_states(states.stdout)
        source = "/sys/class/infiniband/*/ports/*/state"
    active: dict[str, list[int]] = {}
    for nic in exp.nics:
        if nic in absent:
            continue
        st = ports.get(nic, {})
        active[nic] = [n for n, s in st.items() if s in ("PORT_ACTIVE", "ACTIVE")]
        if active[nic]:
            out.append(ok("rdma-port-active", h, f"{nic}: port(s) {', '.join(map(str, active[nic]))} ACTIVE ({source})"))
        else:
            shown = ", ".join(f"port {n} {s}" for n, s in sorted(st.items())) or "no port listed"
            out.append(Finding("rdma-port-active", h, "fail", f"{nic}: {shown} ({source})",
                               "bring the link up: cable/switch port, `ibstat`, the subnet manager (InfiniBand) or the netdev (RoCE: `ip link set ... up`)",
                               KV_RUNBOOK))
    table = P.sysfs_gids(gids.stdout)
    for nic, act in active.items():
        for port in act:
            values = table.get((nic, port), [])
            good = [g for g in values if not P.gid_is_zero(g)]
            if good:
                out.append(ok("rdma-gid", h, f"{nic} port {port}: GID {good[0]}"))
            else:
                out.append(Finding("rdma-gid", h, "fail", f"{nic} port {port}: {'only zero GIDs' if values else 'no GID readable'}",
                                   "RoCE needs an IP address on the NIC's netdev (`ip addr add ... dev <netdev>`); "
                                   "InfiniBand needs the subnet manager to assign the port", KV_RUNBOOK))
    return out


def run_rdma(probe: Probe, exp: HostExpect) -> list[Finding]:
    devices = probe.sh("ibv_devices")
    if missing_tool(devices):
        listing = probe.sh("ls -1 /sys/class/infiniband 2>/dev/null")
        devices = Output(127, listing.stdout, listing.stderr)
    devinfo = probe.sh("ibv_devinfo")
    states = probe.sh("grep -H . /sys/class/infiniband/*/ports/*/state 2>/dev/null")
    gids = probe.sh("grep -H . /sys/class/infiniband/*/ports/*/gids/[0-3] 2>/dev/null")
    return evaluate_rdma(exp, devices, devinfo, states, gids)


def evaluate_peermem(exp: HostExpect, lsmod: Output) -> Finding:
    h = exp.host.name
    if exp.gpu_count == 0:
        return skip("nvidia-peermem", h, "no GPU memory is registered for RDMA on this host (CPU roles)")
    if missing_tool(lsmod):
        return skip("nvidia-peermem", h, "lsmod not found (kmod): cannot list kernel modules", required=False)
    mods = P.lsmod(lsmod.stdout)
    have = [m for m in ("nvidia_peermem", "nv_peer_mem") if m in mods]
    if have:
        return ok("nvidia-peermem", h, f"module {have[0]} loaded")
    return Finding("nvidia-peermem", h, "fail", "neither nvidia_peermem nor nv_peer_mem is loaded (lsmod)",
                   "`modprobe nvidia-peermem` (and add it to /etc/modules-load.d/); without it RDMA cannot register GPU memory", KV_RUNBOOK)


def evaluate_memlock(exp: HostExpect, ulimit: Output, *, rdma: bool, services_mode: str) -> Finding:
    h = exp.host.name
    kib = P.memlock_kib(ulimit.stdout)
    seen = "unlimited" if kib == -1 else (f"{kib} KiB" if kib is not None else repr(ulimit.stdout.strip()))
    if not rdma:
        return ok("memlock", h, f"ulimit -l: {seen} (no RDMA here: nothing is pinned)", required=False)
    if services_mode == "systemd":
        return ok("memlock", h, f"ulimit -l: {seen} in the SSH session; the units set LimitMEMLOCK=infinity", required=False)
    if kib == -1:
        return ok("memlock", h, "ulimit -l: unlimited")
    return Finding("memlock", h, "fail", f"ulimit -l: {seen}; RDMA pins the KV buffers (process mode inherits this limit)",
                   "set `* - memlock unlimited` in /etc/security/limits.d/ (and log in again), or use services: systemd", KV_RUNBOOK)


def evaluate_ucx(exp: HostExpect, ucx: Output) -> Finding:
    """ucx-rdma (nixl): UCX must offer an RDMA transport on each NIC of this host."""
    h = exp.host.name
    if missing_tool(ucx):
        return skip("ucx-rdma", h, "ucx_info not found: cannot list UCX transports (install ucx-utils, or the UCX matching NIXL's)",
                    required=False)
    tls = [t for t in P.ucx_info_devices(ucx.stdout) if t.transport in P.RDMA_UCX_TRANSPORTS]
    if not exp.nics:
        good = bool(tls)
        return Finding("ucx-rdma", h, "ok" if good else "fail", f"RDMA transports: {', '.join(sorted({f'{t.transport}/{t.device}' for t in tls})) or 'none'}",
                       "" if good else "UCX sees no RDMA device: install rdma-core / the MLNX OFED libraries UCX loads", None if good else KV_RUNBOOK)
    missing = [n for n in exp.nics if not any(t.device.split(":")[0] == n for t in tls)]
    if missing:
        return Finding("ucx-rdma", h, "fail", f"no UCX RDMA transport on {', '.join(missing)} (seen: {', '.join(sorted({t.device for t in tls})) or 'none'})",
                       "check `ucx_info -d | grep -B2 Device`; UCX needs the verbs provider (libibverbs, mlx5) for these NICs", KV_RUNBOOK)
    per = {n: sorted({t.transport for t in tls if t.device.split(':')[0] == n}) for n in exp.nics}
    return ok("ucx-rdma", h, "; ".join(f"{n}: {', '.join(v)}" for n, v in per.items()))


def run_rdma_all(probe: Probe, exp: HostExpect, *, transport: str, services_mode: str) -> list[Finding]:
    out = run_rdma(probe, exp)
    out.append(evaluate_peermem(exp, probe.sh("lsmod")))
    if transport == "nixl":
        out.append(evaluate_ucx(exp, probe.sh("ucx_info -d")))
    return out
