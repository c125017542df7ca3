"""How fast is `tilepd plan --json` on a 1000-decode-node topology? Target: under 1 s.

Generates the topology (one 8-GPU prefill host, N 8xB200 decode nodes, a router,
NIXL), then times, side by side in one run:
  - in-process: load_topology + build_plan + JSON dump (what the verb does),
  - a real `tilepd plan FILE --json` process (interpreter start and imports included),
  - the same process on a 1-node topology (the fixed start-up cost, for the ratio).
Run: .venv/bin/python bench/plan_speed.py [--nodes 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_topology(nodes: int) -> str:
    lines = [
        "apiVersion: tilepd/v1",
        "deployment: {name: bench, base_dir: /opt/tilepd/bench, services: systemd}",
        "model:",
        "  served_name: glm5.1",
        "  family: glm5",
        "  hf_path: /models/GLM-5.1",
        "  weights_path: /models/tilepd-glm5.1",
        "  max_seq_len: 202752",
        "  trust_remote_code: true",
        "  kv_cache_dtype: {prefill: fp8_ds_mla, decode: fp8}",
        "  tensor_parallel: {prefill: 8, decode: 8}",
        "  speculative:",
        "    prefill: {method: mtp, num_speculative_tokens: 1}",
        "    decode: {method: mtp, num_speculative_tokens: 1}",
        "transport: {name: nixl}",
        "prefill:",
        "  - {name: p0, address: 10.200.0.1, gpus: 8, nics: [mlx5_0, mlx5_1], port: 8000, enforce_eager: true}",
        "decode:",
    ]
    for i in range(nodes):
        addr = f"10.{201 + i // 65536}.{(i // 256) % 256}.{i % 256}"
        lines.append(f"  - {{name: d{i}, address: {addr}, gpu: {{type: B200, count: 8}}, nics: [mlx5_0, mlx5_1], ctrl_port: 5556, http_port: 5557}}")
    lines.append("router: {name: router, address: 10.200.0.2, port: 23333}")
    return "\n".join(lines) + "\n"


Timing = tuple[float, float]  # (wall seconds, CPU seconds), medians


def time_in_process(path: Path, repeat: int) -> tuple[Timing, int]:
    from tilepd.plan import build_plan
    from tilepd.topology import load_topology

    walls, cpus, size = [], [], 0
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        text = build_plan(load_topology(path)).model_dump_json(indent=2)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        size = len(text)
    return (statistics.median(walls), statistics.median(cpus)), size


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_process(path: Path, repeat: int) -> Timing:
    exe = Path(sys.executable).parent / "tilepd"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tilepd"]
    walls, cpus = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), _children_cpu()
        proc = subprocess.run([*cmd, "plan", str(path), "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        walls.append(time.perf_counter() - w0)
        cpus.append(_children_cpu() - c0)
        if proc.returncode != 0:
            raise SystemExit(f"tilepd plan failed ({proc.returncode}): {proc.stderr}")
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tilepd-bench-") as tmp:
        big, small = Path(tmp) / f"bench-{args.nodes}.yaml", Path(tmp) / "bench-1.yaml"
        big.write_text(make_topology(args.nodes))
        small.write_text(make_topology(1))
        in_proc, size = time_in_process(big, args.repeat)
        proc_big = time_process(big, args.repeat)
        proc_small = time_process(small, args.repeat)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, Python {platform.python_version()}, {platform.platform()}")
    print(f"topology: {args.nodes} decode nodes; plan JSON {size / 1e6:.2f} MB; medians of {args.repeat}; wall and CPU seconds (CPU is what a loaded machine does not inflate)")
    for label, (wall, cpu) in (
        ("in-process load+plan+dump", in_proc),
        (f"`tilepd plan --json`, {args.nodes} nodes", proc_big),
        ("`tilepd plan --json`, 1 node", proc_small),
    ):
        print(f"{label:<36} wall {wall:6.3f} s ({wall:.2f}x of the 1 s target)  cpu {cpu:6.3f} s")
    print(f"{args.nodes}-node process / 1-node process: wall {proc_big[0] / proc_small[0]:.2f}x, cpu {proc_big[1] / proc_small[1]:.2f}x")


if __name__ == "__main__":
    main()
