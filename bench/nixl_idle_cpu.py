"""Idle CPU of a NIXL agent, NIXL alone: the progress thread busy-polls (issue 13 part 8).

NIXL's python binding (nixl._api.nixl_agent) sets the progress thread's delay to 0
(`agent_config.pthrDelay = 0`), so an agent built with the default config
(enable_prog_thread=True) spins a whole core even when nothing happens. vLLM's
NixlConnector builds its agent with `nixl_agent_config(num_threads=4,
capture_telemetry=True)` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py),
i.e. with the progress thread: every vLLM instance with NixlConnector spins one core.
tilepd's own transport uses enable_prog_thread=False (tilepd/transport/nixl_transport.py).

Each case runs in its own process: N agents (each with a registered 1 MiB DRAM buffer;
`--connected` also exchanges metadata between agent pairs and makes the UCX connection,
as a prefill/decode pair does), then sleeps `--seconds` and reports the process's CPU
seconds over that idle window, per agent, and the busiest thread.

    python bench/nixl_idle_cpu.py [--seconds 5] [--agents 1] [--connected]

Prints one line per case and a JSON summary (`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

CASES = {
    "default (progress thread on)": "dict()",
    "vLLM NixlConnector config": "dict(num_threads=4, capture_telemetry=True)",
    "no progress thread (tilepd)": "dict(enable_prog_thread=False)",
}


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process: {'name/tid': seconds}."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def child(kwargs_src: str, agents: int, connected: bool, seconds: float) -> dict[str, Any]:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    kwargs = eval(kwargs_src, {})  # noqa: S307 - one of the literals in CASES
    made, bufs = [], []
    for i in range(agents * (2 if connected else 1)):
        a = nixl_agent(f"idle-{os.getpid()}-{i}", nixl_agent_config(backends=["UCX"], **kwargs))
        buf = np.zeros(1 << 20, np.uint8)
        a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        made.append(a)
        bufs.append(buf)
    if connected:
        for a, b in zip(made[0::2], made[1::2]):
            name = a.add_remote_agent(b.get_agent_metadata())
            b.add_remote_agent(a.get_agent_metadata())
            a.make_connection(name.decode() if isinstance(name, bytes) else name)
    time.sleep(0.5)  # let start-up settle
    before, c0, w0 = _thread_cpu(), time.process_time(), time.monotonic()
    time.sleep(seconds)
    after, c1, w1 = _thread_cpu(), time.process_time(), time.monotonic()
    deltas = {k: after[k] - before.get(k, 0.0) for k in after}
    busiest = max(deltas, key=deltas.get) if deltas else "-"
    if busiest.endswith(f"/{os.getpid()}"):
        busiest += " (main thread)"
    else:
        busiest += " (not the main thread)"
    return {"agents": len(made), "idle_s": w1 - w0, "cpu_s": c1 - c0, "cpu_s_per_agent": (c1 - c0) / len(made),
            "busiest_thread": busiest, "busiest_cpu_s": deltas.get(busiest.split(" ")[0], 0.0), "threads": len(after)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="idle window measured")
    ap.add_argument("--agents", type=int, default=1, help="agents per case (pairs with --connected)")
    ap.add_argument("--connected", action="store_true", help="agents in connected pairs (metadata exchanged, UCX endpoint made)")
    ap.add_argument("--json", action="store_true", help="print the JSON summary only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.agents, args.connected, args.seconds)))
        return
    results = {}
    if not args.json:
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a spinning thread gets less than a core on a loaded box)")
    for label, src in CASES.items():
        cmd = [sys.executable, __file__, "--child", src, "--agents", str(args.agents), "--seconds", str(args.seconds)]
        if args.connected:
            cmd.append("--connected")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 120)
        if p.returncode != 0:
            raise SystemExit(f"case {label!r} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        results[label] = r
        if not args.json:
            print(f"{label:32s} {r['agents']} agent(s): {r['cpu_s']:.3f} CPU-s in {r['idle_s']:.1f} s idle "
                  f"({r['cpu_s_per_agent'] / r['idle_s'] * 100:.1f}% of a core per agent); busiest thread "
                  f"{r['busiest_thread']} {r['busiest_cpu_s']:.2f} s")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
