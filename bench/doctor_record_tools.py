"""Record the host tools `tilepd doctor` parses, on a machine that has the hardware, and parse them.

The doctor's GPU/RDMA checks are tested against outputs transcribed from the tools' documented formats
(tests/doctor/fixtures/SOURCES.md); run this on a GPU (and, where there is one, RDMA) machine to record
real ones: each output is written to OUT/<name> with the tool's version in OUT/SOURCES.txt, and parsed
with tilepd.doctor.parsers; a tool that is present but whose output does not parse exits 1.

    python bench/doctor_record_tools.py --out "$OUT/doctor-fixtures"
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.doctor import parsers as P
from tilepd.doctor.checks_hw import NVIDIA_SMI

# name -> (command, version command, parser: text -> parsed (falsy = not understood))
TOOLS = {
    "nvidia_smi_recorded.csv": (NVIDIA_SMI, "nvidia-smi --version | head -3", P.nvidia_smi_gpus),
    "ibv_devices_recorded.txt": ("ibv_devices", "ibv_devinfo --version", P.ibv_devices),
    "ibv_devinfo_recorded.txt": ("ibv_devinfo", "ibv_devinfo --version", P.ibv_devinfo),
    "sysfs_port_states_recorded.txt": ("grep -H . /sys/class/infiniband/*/ports/*/state", "uname -r", P.sysfs_port_states),
    "sysfs_gids_recorded.txt": ("grep -H . /sys/class/infiniband/*/ports/*/gids/[0-3]", "uname -r", P.sysfs_gids),
    "lsmod_recorded.txt": ("lsmod", "kmod --version", P.lsmod),
    "ucx_info_d_recorded.txt": ("ucx_info -d", "ucx_info -v | head -2", P.ucx_info_devices),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sources, bad = [], []
    for name, (cmd, version_cmd, parse) in TOOLS.items():
        tool = cmd.split()[0]
        if tool != "grep" and shutil.which(tool) is None:
            print(f"{name}: {tool} not installed, skipped")
            continue
        res = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
        if tool == "grep" and not res.stdout:
            print(f"{name}: no /sys/class/infiniband here, skipped")
            continue
        version = subprocess.run(version_cmd, shell=True, capture_output=True, text=True).stdout.strip().replace("\n", " / ")
        (args.out / name).write_text(res.stdout)
        parsed = parse(res.stdout)
        sources.append(f"{name}\t`{cmd}`\trc {res.returncode}\t{version}")
        print(f"{name}: rc {res.returncode}, parsed: {parsed!r}"[:2000])
        if not parsed:
            bad.append(name)
    (args.out / "SOURCES.txt").write_text("\n".join(sources) + "\n")
    if bad:
        print(f"not understood: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
