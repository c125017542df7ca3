"""Lowering the priority of the threads of a test's server that burn a core while it is idle.

vLLM's NixlConnector creates its NIXL agent with the progress thread on and NIXL's python API fixes that thread's poll
delay at 0 (nixl/_api.py: `pthrDelay = 0`), so the thread polls without pause: each vLLM with a NixlConnector (the
router tests' prefill and native decode, the NIXL hand-off module's prefill) keeps one core busy for as long as it
lives, measured at 0.9-1.0 core per process on the 2-core CI box, where that halved the CPU every other process of
the test got (the router tests' routers, decode nodes and vLLM's own compute threads; the prefill's worker even shares
its bound core with its own spinning thread). Neither vLLM nor NIXL has a setting for that delay.

The thread keeps running, at nice 19: when a core is free it polls as before; it only stops taking the CPU from the
processes the test is about. Nothing it does changes: KV transfers, handshakes and notifications go through it as
before (a core of this box is idle most of the time during a hand-off, and the consumer also progresses the transfer
from its own thread when it checks the transfer's state).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

MIN_TICKS = 3  # CPU over the window (clock ticks, 10 ms each) that a thread which never slept must have used
NICE = 19


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields((entry / "stat").read_text())[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _stat_fields(raw: str) -> list[str]:
    """The fields of a /proc stat line after its `(name)`, which may hold spaces."""
    return raw[raw.rindex(")") + 2:].split()


def _thread_ticks(pids: list[int]) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (CPU clock ticks, voluntary context switches) of every thread of `pids`."""
    ticks: dict[tuple[int, int], tuple[int, int]] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = _stat_fields(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            voluntary = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches"))
            ticks[(pid, int(tid))] = (int(fields[11]) + int(fields[12]), voluntary)  # utime + stime
    return ticks


def renice_idle_spinners(root_pid: int, window_s: float = 1.0) -> list[int]:
    """Renice (19) every thread of `root_pid` and its descendants that ran over `window_s` without sleeping once (no
    voluntary context switch: it polls without pause); call it while the server is idle (after its start or warm-up),
    when no thread has work. Returns the thread ids reniced; an empty list is not an error (a server without such a
    thread: nothing is lost but time)."""
    pids = _descendants(root_pid)
    before = _thread_ticks(pids)
    time.sleep(window_s)
    after = _thread_ticks(pids)
    reniced = []
    for key, (ticks, voluntary) in after.items():
        if key in before and ticks - before[key][0] >= MIN_TICKS and voluntary == before[key][1]:
            try:
                os.setpriority(os.PRIO_PROCESS, key[1], NICE)  # a thread id: that thread only (Linux)
            except OSError:
                continue
            reniced.append(key[1])
    return reniced
