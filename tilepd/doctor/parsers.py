"""Parsers for the output of the host tools `tilepd doctor` runs, in their documented formats.

Pure functions (text in, data out) so every format is tested against recorded output of the real
tool (tests/doctor/fixtures/). Each parser names the command line it expects; a line it cannot read
is skipped, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    driver: str
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None


def _mib(value: str) -> int | None:
    """`81559` (nounits) or `81559 MiB` -> bytes; `[N/A]`, `[Not Supported]` -> None."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(MiB)?\s*", value)
    return int(float(m.group(1)) * MIB) if m else None


def nvidia_smi_gpus(text: str) -> list[GpuInfo]:
    """`nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,memory.free --format=csv,noheader,nounits`."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6 or not parts[0].isdigit():
            continue
        out.append(GpuInfo(int(parts[0]), parts[1], parts[2], _mib(parts[3]), _mib(parts[4]), _mib(parts[5])))
    return out


def driver_tuple(version: str) -> tuple[int, ...] | None:
    """`570.86.15` -> (570, 86, 15); None when it is not a dotted number."""
    return tuple(int(p) for p in version.split(".")) if re.fullmatch(r"\d+(\.\d+)*", version.strip()) else None


@dataclass
class IbPort:
    state: str  # PORT_ACTIVE, PORT_DOWN, PORT_INIT, ... (ibv_devinfo) or ACTIVE, DOWN (sysfs)
    link_layer: str | None = None


@dataclass
class IbDevice:
    name: str
    ports: dict[int, IbPort] = field(default_factory=dict)


def ibv_devices(text: str) -> list[str]:
    """`ibv_devices`: a header (`device  node GUID`), a dashed line, then `<name> <16 hex guid>` per device."""
    names = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(r"[0-9a-fA-F]{16}", parts[1]):
            names.append(parts[0])
    return names


def ibv_devinfo(text: str) -> dict[str, IbDevice]:
    """`ibv_devinfo [-d DEV]`: `hca_id:\\tNAME` blocks, `port:\\tN` sub-blocks with `state:` and `link_layer:`."""
    devices: dict[str, IbDevice] = {}
    dev: IbDevice | None = None
    port: IbPort | None = None
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        value = value.strip()
        if key == "hca_id":
            dev = devices.setdefault(value, IbDevice(value))
            port = None
        elif key == "port" and dev is not None and value.isdigit():
            port = dev.ports.setdefault(int(value), IbPort(state="?"))
        elif key == "state" and port is not None:
            port.state = value.split()[0]
        elif key == "link_layer" and port is not None:
            port.link_layer = value
    return devices


def sysfs_port_states(text: str) -> dict[str, dict[int, str]]:
    """`grep -H . /sys/class/infiniband/*/ports/*/state`: `/sys/.../DEV/ports/N/state:4: ACTIVE` per port."""
    out: dict[str, dict[int, str]] = {}
    for line in text.splitlines():
        m = re.match(r"^/sys/class/infiniband/([^/]+)/ports/(\d+)/state:\s*\d+:\s*(\w+)", line)
        if m:
            out.setdefault(m.group(1), {})[int(m.group(2))] = m.group(3)
    return out


def sysfs_gids(text: str) -> dict[tuple[str, int], list[str]]:
    """`grep -H . /sys/class/infiniband/DEV/ports/*/gids/N`: `/sys/.../DEV/ports/P/gids/N:fe80:0000:...` per GID."""
    out: dict[tuple[str, int], list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^/sys/class/infiniband/([^/]+)/ports/(\d+)/gids/\d+:([0-9a-fA-F:]{39})$", line.strip())
        if m:
            out.setdefault((m.group(1), int(m.group(2))), []).append(m.group(3).lower())
    return out


def gid_is_zero(gid: str) -> bool:
    return set(gid.replace(":", "")) <= {"0"}


def lsmod(text: str) -> set[str]:
    """`lsmod`: a `Module Size Used by` header, then `<name> <size> <count> [users]` per loaded module."""
    mods = set()
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[1].isdigit():
            mods.add(parts[0])
    return mods


def memlock_kib(text: str) -> int | None:
    """`ulimit -l` (POSIX sh/bash: KiB, or `unlimited`) -> KiB, -1 for unlimited, None if unreadable."""
    value = text.strip()
    if value == "unlimited":
        return -1
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class UcxTransport:
    transport: str
    device: str


RDMA_UCX_TRANSPORTS = frozenset({"rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5"})


def ucx_info_devices(text: str) -> list[UcxTransport]:
    """`ucx_info -d`: `#      Transport: rc_mlx5` followed (within its block) by `#         Device: mlx5_0:1`."""
    out = []
    transport: str | None = None
    for line in text.splitlines():
        m = re.match(r"^#\s*(Transport|Device):\s*(\S+)", line)
        if not m:
            continue
        if m.group(1) == "Transport":
            transport = m.group(2)
        elif transport is not None:
            out.append(UcxTransport(transport, m.group(2)))
            transport = None
    return out


@dataclass(frozen=True)
class ListeningSocket:
    address: str  # `0.0.0.0`, `::`, `*`, `127.0.0.1`, ...
    port: int
    pid: int | None
    process: str | None


WILDCARDS = frozenset({"0.0.0.0", "::", "*", "[::]"})


def ss_listeners(text: str) -> list[ListeningSocket]:
    """`ss -ltnpH` (or without -H/-p): `LISTEN recv-q send-q LOCAL:PORT PEER:PORT [users:(("name",pid=N,fd=M))]`."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[0] != "LISTEN":
            continue
        host, _, port = parts[3].rpartition(":")
        if not port.isdigit():
            continue
        host = host.split("%", 1)[0].strip("[]")
        if host.startswith("::ffff:"):
            host = host[len("::ffff:"):]
        users = " ".join(parts[5:])
        m = re.search(r'\("([^"]*)",pid=(\d+)', users)
        out.append(ListeningSocket(host or "*", int(port), int(m.group(2)) if m else None, m.group(1) if m else None))
    return out


@dataclass(frozen=True)
class DiskFree:
    target: str
    avail_bytes: int


def df_avail(text: str) -> DiskFree | None:
    """`df -B1 --output=target,avail PATH`: a header line, then `<mount point> <bytes>`."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return None
    target, _, avail = lines[-1].strip().rpartition(" ")
    return DiskFree(target.strip(), int(avail)) if avail.isdigit() else None


def du_bytes(text: str) -> int | None:
    """`du -sb PATH`: `<bytes>\\t<path>`."""
    first = text.split()
    return int(first[0]) if first and first[0].isdigit() else None


def epoch_seconds(text: str) -> float | None:
    """`date +%s.%N` -> seconds since the epoch (GNU date; busybox prints a literal `%N`, read as whole seconds)."""
    value = text.strip().replace(".%N", "").replace("%N", "")
    try:
        return float(value)
    except ValueError:
        return None


def stat_sizes(text: str) -> dict[str, int]:
    """`stat -c '%n %s' FILE...`: `<path> <bytes>` per existing file (missing ones only print to stderr)."""
    out = {}
    for line in text.splitlines():
        name, _, size = line.rpartition(" ")
        if name and size.isdigit():
            out[name] = int(size)
    return out
