"""systemd unit and EnvironmentFile text for a planned service."""

from __future__ import annotations

import re

from tilepd.plan.model import Plan, Service
from tilepd.plan.vllm_args import SECRET_FILE_ENV

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


def quote_path(word: str) -> str:
    """One path or assignment in a setting that expands %-specifiers but not $VARIABLES (`ReadWritePaths=`,
    `BindReadOnlyPaths=`, `Environment=`): quoted when it needs it (a colon too: it separates a bind's source and
    destination), % doubled."""
    if word and _SAFE_WORD.match(word) and ":" not in word:
        return word.replace("%", "%%")
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def exec_start(argv: list[str]) -> str:
    return " ".join(quote_exec_arg(a) for a in argv)


def env_file_text(env: dict[str, str]) -> str:
    """KEY="value" lines (EnvironmentFile syntax: double quotes, backslash escapes)."""
    lines = []
    for key, value in env.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        lines.append(f'{key}="{escaped}"')
    return "\n".join(lines) + ("\n" if lines else "")


def data_dir(base_dir: str) -> str:
    """The one folder a unit's service writes (caches, a decode node's drain state): in systemd mode the playbooks give
    it to the service user; the rest of the base dir (configs, env and spec files, secrets) stays the SSH user's."""
    return f"{base_dir.rstrip('/')}/data"


def secret_paths(service: Service) -> list[str]:
    """Files a service reads a secret from at start: its config's `secret_file` and `api_key_file`, a vLLM's
    TILEPD_VLLM_SECRET_FILE (its API key derives from it, tilepd.connector.vllm_auth)."""
    cfg = service.config or {}
    found = (cfg.get("secret_file"), cfg.get("api_key_file"), service.env.get(SECRET_FILE_ENV))
    return list(dict.fromkeys(str(p) for p in found if p))


def secret_copy(base_dir: str, path: str) -> str:
    """Where the service user's copy of the secret file `path` lives on its host: `<data>/secrets/<name>` (the name
    under `<base_dir>/secrets/`, or the whole path made one word for a file elsewhere, e.g. the router's api_key.file)."""
    secrets = f"{base_dir.rstrip('/')}/secrets/"
    name = path[len(secrets):] if path.startswith(secrets) else path.lstrip("/")
    return f"{data_dir(base_dir)}/secrets/{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"


def secret_copies(service: Service) -> list[tuple[str, str]]:
    """(secret file, the service user's copy) for each secret the service reads. `up` writes the copy (owned by the
    service user, 0600) whenever the secret changes, and the unit shows it at the secret's own path
    (`BindReadOnlyPaths=`), so the service reads the path its config names while the file itself stays 0600 and the
    SSH user's (`up` keeps and rotates it without privileges, `tilepd drain` reads it over SSH). Not
    `LoadCredential=`, nor a copy made by the unit's `ExecStartPre=+`: under systemd 252 a bind whose source does not
    exist yet fails the unit at NAMESPACE, and a credential does not exist yet then (docs/RELIABILITY.md, "Security")."""
    return [(path, secret_copy(service.cwd, path)) for path in secret_paths(service)]


_TMP_DIRS = ("/tmp", "/var/tmp")
# every unit: no privilege gain, no writes to kernel knobs, modules, cgroups, clock or hostname, no SUID/SGID files
HARDENING = ["NoNewPrivileges=yes", "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes",
             "ProtectControlGroups=yes", "ProtectClock=yes", "ProtectHostname=yes", "RestrictSUIDSGID=yes",
             "RestrictRealtime=yes", "LockPersonality=yes", "SystemCallArchitectures=native"]


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def service_paths(service: Service) -> list[tuple[str, str]]:
    """(absolute path, where the service names it) for its interpreter, base dir, argv, env and config: what its
    sandbox must show and its user must be able to use."""
    out = [(service.python, "interpreter"), (service.cwd, "working directory")]
    out += [(a, "argv") for a in service.argv[1:] if a.startswith("/")]
    out += [(v, k) for k, v in service.env.items() if v.startswith("/")]
    stack: list[tuple[str, object]] = [("config", service.config or {})]
    while stack:
        key, item = stack.pop()
        if isinstance(item, dict):
            stack += [(str(k), v) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(key, v) for v in item]
        elif isinstance(item, str) and item.startswith("/"):
            out.append((item, key))
    return out


def sandbox(service: Service) -> list[str]:
    """The sandbox of a daemon: the whole file system read-only but its data dir (`ProtectSystem=strict`, home
    directories too: `ProtectHome=read-only`, not `yes`, because a venv's interpreter is often a symlink into a
    pyenv or conda under a home, which the plan cannot see from here), its secrets as copies it owns, and a private
    /tmp unless the service's own paths (interpreter, weights, base dir) live there (then TMPDIR is its data dir).
    Oneshots (weights download and conversion) write where the topology says and get only the common hardening."""
    if service.kind == "oneshot":
        return []
    paths = [p for p, _ in service_paths(service)]
    data = data_dir(service.cwd)
    lines = ["ProtectSystem=strict", f"ReadWritePaths={quote_path(data)}",
             # HOME and the caches (vLLM's compile cache, Hugging Face, Triton) in the data dir, the one place it may
             # write; the EnvironmentFile (the topology's env) is read after these and wins
             "Environment=" + " ".join(quote_path(f"{k}={v}") for k, v in
                                       (("HOME", data), ("XDG_CACHE_HOME", f"{data}/cache"), ("XDG_CONFIG_HOME", f"{data}/config"),
                                        ("TRITON_CACHE_DIR", f"{data}/cache/triton")))]
    lines.append("ProtectHome=read-only")
    lines += [f"BindReadOnlyPaths={quote_path(copy)}:{quote_path(path)}" for path, copy in secret_copies(service)]
    if not any(_under(p, _TMP_DIRS) for p in paths):
        lines.append("PrivateTmp=yes")
    else:  # /tmp stays the machine's and read-only (ProtectSystem=strict): temp files go to the data dir
        lines.append(f"Environment={quote_path(f'TMPDIR={data}')}")
    if service.role in ("router", "balancer"):
        lines += ["PrivateDevices=yes", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK"]
    low = sorted(p for p in service.ports.values() if 0 < p < 1024)
    # no capability at all, but the one to bind a port below 1024 where the topology names one
    lines.append("CapabilityBoundingSet=CAP_NET_BIND_SERVICE" if low else "CapabilityBoundingSet=")
    if low:
        lines.append("AmbientCapabilities=CAP_NET_BIND_SERVICE")
    return lines


def unit_text(plan: Plan, service: Service, env_file: str) -> str:
    """The unit for `service`: as the service user, restart on failure (daemons), raised limits, output to journald."""
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
        # the dedicated user the playbooks create (deployment.service_user), never root; its group of the same name
        f"User={plan.service_user}",
        f"Group={plan.service_user}",
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
