"""systemd unit and EnvironmentFile text for a planned service."""

from __future__ import annotations

import re

from tilepd.plan.model import Plan, Service

_SAFE_WORD = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")
# A decode node tells systemd when it serves (READY=1) and pings from its serving loop's tick (WATCHDOG=1,
# tilepd.runtime.liveness); no ping for this long and systemd kills and restarts it (Restart=on-failure). Longer
# than a SIGSTOP a node must survive (20 s, docs/RELIABILITY.md) and than the loop stalls seen on a loaded box.
DECODE_WATCHDOG_S = 30
# Type=notify waits for READY=1: loading a large model's weights takes minutes; `tilepd up`'s health gate bounds it
DECODE_START_TIMEOUT_S = 1800


def _escape_specials(text: str) -> str:
    # systemd expands %-specifiers and $VARIABLES in ExecStart; double them to mean themselves
    return text.replace("%", "%%").replace("$", "$$")


def quote_exec_arg(arg: str) -> str:
    """One argv word as systemd's ExecStart parser reads it back unchanged."""
    if arg and _SAFE_WORD.match(arg):
        return _escape_specials(arg)
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return '"' + _escape_specials(escaped) + '"'


def exec_start(argv: list[str]) -> str:
    return " ".join(quote_exec_arg(a) for a in argv)


def env_file_text(env: dict[str, str]) -> str:
    """KEY="value" lines (EnvironmentFile syntax: double quotes, backslash escapes)."""
    lines = []
    for key, value in env.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        lines.append(f'{key}="{escaped}"')
    return "\n".join(lines) + ("\n" if lines else "")


_TMP_DIRS = ("/tmp", "/var/tmp")
# every unit: no privilege gain, no writes to kernel knobs, modules, cgroups, clock or hostname, no SUID/SGID files
HARDENING = ["NoNewPrivileges=yes", "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes",
             "ProtectControlGroups=yes", "ProtectClock=yes", "ProtectHostname=yes", "RestrictSUIDSGID=yes",
             "RestrictRealtime=yes", "LockPersonality=yes", "SystemCallArchitectures=native"]


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _paths(service: Service) -> list[str]:
    """The absolute paths a service names (its interpreter, base dir, argv, env, config): what its sandbox must show."""
    out = [service.python, service.cwd, *(a for a in service.argv if a.startswith("/"))]
    out += [v for v in service.env.values() if v.startswith("/")]
    stack: list = [service.config or {}]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += list(item.values())
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str) and item.startswith("/"):
            out.append(item)
    return out


def sandbox(service: Service) -> list[str]:
    """The sandbox of a daemon: the whole file system read-only but its base dir (`ProtectSystem=strict`, home
    directories too: `ProtectHome=read-only`, not `yes`, because a venv's interpreter is often a symlink into a
    pyenv or conda under a home, which the plan cannot see from here), and a private /tmp unless the service's own
    paths (interpreter, weights, base dir) live there. Oneshots (weights download and conversion) write where the
    topology says and get only the common hardening."""
    if service.kind == "oneshot":
        return []
    paths = _paths(service)
    base = service.cwd
    lines = ["ProtectSystem=strict", f"ReadWritePaths={quote_exec_arg(base)}",
             # caches (vLLM's compile cache, Hugging Face, Triton) in the base dir, the one place it may write; the
             # EnvironmentFile (the topology's env) is read after these and wins
             "Environment=" + " ".join(quote_exec_arg(f"{k}={base}/{v}") for k, v in
                                       (("XDG_CACHE_HOME", "cache"), ("XDG_CONFIG_HOME", "config"), ("TRITON_CACHE_DIR", "cache/triton")))]
    lines.append("ProtectHome=read-only")
    if not any(_under(p, _TMP_DIRS) for p in paths):
        lines.append("PrivateTmp=yes")
    if service.role in ("router", "balancer"):
        lines += ["PrivateDevices=yes", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK"]
    low = sorted(p for p in service.ports.values() if 0 < p < 1024)
    # no capability at all, but the one to bind a port below 1024 where the topology names one
    lines.append("CapabilityBoundingSet=CAP_NET_BIND_SERVICE" if low else "CapabilityBoundingSet=")
    if low:
        lines.append("AmbientCapabilities=CAP_NET_BIND_SERVICE")
    return lines


def unit_text(plan: Plan, service: Service, env_file: str) -> str:
    """The unit for `service`: restart on failure (daemons), raised limits, output to journald."""
    oneshot = service.kind == "oneshot"
    unit = [
        "[Unit]",
        f"Description=tilepd {plan.deployment}: {service.role} {service.name}",
        "After=network-online.target",
        "Wants=network-online.target",
    ]
    if service.creates:
        unit.append(f"ConditionPathExists=!{service.creates}")
    notify = service.role == "decode" and not oneshot
    svc = [
        "",
        "[Service]",
        f"Type={'oneshot' if oneshot else 'notify' if notify else 'simple'}",
    ]
    if oneshot:
        svc.append("RemainAfterExit=yes")
    if notify:
        svc += ["NotifyAccess=main", f"WatchdogSec={DECODE_WATCHDOG_S}", f"TimeoutStartSec={DECODE_START_TIMEOUT_S}"]
    svc += [
        f"WorkingDirectory={service.cwd}",
        f"EnvironmentFile={env_file}",
        f"ExecStart={exec_start(service.argv)}",
    ]
    if not oneshot:
        svc += ["Restart=on-failure", "RestartSec=5"]
    # stop, restart and a crash end every process of the unit's cgroup, also children whose parent died
    # (vLLM's EngineCore and workers would otherwise keep their ports and block the next start)
    svc.append("KillMode=control-group")
    svc += HARDENING + sandbox(service)
    svc.append("LimitNOFILE=1048576")
    if plan.rdma:
        svc.append("LimitMEMLOCK=infinity")  # RDMA registers (pins) the KV buffers
    svc += [
        # output to journald, which caps its own storage (SystemMaxUse); process mode rotates log_file instead
        "StandardOutput=journal",
        "StandardError=inherit",
        f"SyslogIdentifier=tilepd-{service.name}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(unit + svc)
