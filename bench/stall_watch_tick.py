"""What one tick of the decode node's stall watch costs its serving loop (tilepd/runtime/stall_watch.py).

    python bench/stall_watch_tick.py [--threads 40] [--ticks 2000] [--rounds 7]

A tick runs on the node's event loop every 0.5 s. It now reads /proc/self/stat and the first line of /proc/stat;
the per-thread counts (one /proc/self/task/<tid>/stat read per thread) are taken every 5 s and at a stall. Before
(session 13) every tick read all three in full. This starts `--threads` idle threads (a GPU node's process holds
dozens: torch, OpenMP, NCCL, the engine's), then times both kinds of tick alternately on the same process and
prints, as one JSON line, the median microseconds per tick of each, their ratio, and the per-thread read the
current tick still makes every 10th tick (5 s / 0.5 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from tilepd.runtime.stall_watch import machine_cpu_seconds, process_cpu_and_faults, thread_cpu_seconds


def tick_now() -> None:
    """What a tick reads today."""
    process_cpu_and_faults()
    machine_cpu_seconds()


def tick_before() -> None:
    """What a tick read before: every thread, all of /proc/stat, /proc/self/stat."""
    thread_cpu_seconds()
    Path("/proc/stat").read_text().splitlines()[0].split()
    process_cpu_and_faults()


def per_tick_us(fn, ticks: int) -> float:
    start = time.perf_counter()
    for _ in range(ticks):
        fn()
    return (time.perf_counter() - start) / ticks * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=40)
    ap.add_argument("--ticks", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait, name=f"idle-{i}", daemon=True) for i in range(args.threads)]
    for t in idle:
        t.start()
    in_process = len(thread_cpu_seconds())
    try:
        now, before, threads_only = [], [], []
        for _ in range(args.rounds):  # alternating, so load on the box falls on both alike
            before.append(per_tick_us(tick_before, args.ticks))
            now.append(per_tick_us(tick_now, args.ticks))
            threads_only.append(per_tick_us(thread_cpu_seconds, args.ticks))
    finally:
        stop.set()
    now_us, before_us, threads_us = statistics.median(now), statistics.median(before), statistics.median(threads_only)
    print(json.dumps({
        "threads_in_process": in_process,
        "tick_before_us": round(before_us, 1),
        "tick_now_us": round(now_us, 1),
        "before_over_now": round(before_us / now_us, 2),
        "per_thread_read_us": round(threads_us, 1),
        "now_with_its_every_10th_tick_per_thread_read_us": round(now_us + threads_us / 10, 1),
    }))


if __name__ == "__main__":
    main()
