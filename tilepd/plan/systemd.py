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
