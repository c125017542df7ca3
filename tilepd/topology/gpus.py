"""Memory per GPU of the GPU types the memory-fit rule knows, with where each figure comes from.

Figures are what the driver reports as `memory.total` (nvidia-smi, MiB), not the datasheet's rounded
"141 GB": that is the memory a process can actually be given (less the CUDA context, which the rule counts
as workspace). A type not listed here is stated in the topology (`gpu.memory_gib` / `gpu_memory_gib`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_bytes: int
    source: str


_TYPES: tuple[tuple[tuple[str, ...], GpuType], ...] = (
    # nvidia-smi on H100 80GB HBM3 (SXM5) and H100 PCIe: "81559MiB"
    (("H100", "H100-80GB", "H100-SXM", "H100-SXM5", "H100-PCIE"), GpuType("H100 80GB", 81559 * MIB, "nvidia-smi memory.total 81559 MiB")),
    # nvidia-smi on H200 (141 GB HBM3e): "143771MiB"
    (("H200", "H200-141GB", "H200-SXM", "H200-NVL"), GpuType("H200 141GB", 143771 * MIB, "nvidia-smi memory.total 143771 MiB")),
    # nvidia-smi on B200 (HGX/DGX B200, 180 GB HBM3e per GPU as NVIDIA lists it): "183359MiB"
    (("B200", "B200-180GB", "B200-192GB"), GpuType("B200", 183359 * MIB, "nvidia-smi memory.total 183359 MiB")),
    # B300: datasheet 288 GB HBM3e, taken as 288e9 bytes (no driver figure at hand; the real total is not below it)
    (("B300", "B300-288GB"), GpuType("B300", 288 * 10**9, "NVIDIA HGX B300 datasheet: 288 GB HBM3e per GPU")),
    # nvidia-smi on A100-SXM4-80GB / A100 80GB PCIe: "81920MiB"
    (("A100-80GB", "A100-SXM4-80GB", "A100-PCIE-80GB"), GpuType("A100 80GB", 81920 * MIB, "nvidia-smi memory.total 81920 MiB")),
    # nvidia-smi on A100-PCIE-40GB: "40536MiB" (A100-SXM4-40GB reports 40960; the smaller is taken)
    (("A100-40GB", "A100-SXM4-40GB", "A100-PCIE-40GB"), GpuType("A100 40GB", 40536 * MIB, "nvidia-smi memory.total 40536 MiB (PCIe; SXM4 40960)")),
    # nvidia-smi on L40S (48 GB GDDR6): "46068MiB"
    (("L40S",), GpuType("L40S", 46068 * MIB, "nvidia-smi memory.total 46068 MiB")),
    # nvidia-smi on L4 (24 GB GDDR6): "23034MiB"
    (("L4",), GpuType("L4", 23034 * MIB, "nvidia-smi memory.total 23034 MiB")),
)


def _key(name: str) -> str:
    """`NVIDIA H100 80GB HBM3`, `h100-80gb`, `H100_SXM` -> comparable words."""
    text = re.sub(r"^NVIDIA[\s_-]*", "", name.strip().upper())
    return re.sub(r"[\s_]+", "-", text).replace("HBM3E", "").replace("HBM3", "").strip("-")


_BY_KEY: dict[str, GpuType] = {_key(alias): gpu for aliases, gpu in _TYPES for alias in aliases}


def known_gpu(name: str) -> GpuType | None:
    """The table entry for a GPU type name (case, `NVIDIA ` prefix, spaces/underscores and HBM suffix ignored)."""
    return _BY_KEY.get(_key(name))


def known_gpu_names() -> list[str]:
    """One name per table entry, for messages."""
    return [aliases[0] for aliases, _ in _TYPES]
