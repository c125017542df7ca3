"""Say where a decode node went when it stopped answering.

A node that answers nothing for seconds (no /health, no control frames, no log line) is taken out of rotation by
the router, and its own log is silent about why. Two witnesses close that gap:

- a tick on the event loop every `tick_s`, watched by a witness thread: when the loop has not ticked for
  `dump_after_s`, the witness writes every Python thread's stack to the log (in faulthandler's format), so a blocked
  loop shows where it is;
- at the tick after a late one, one `event=loop_stall` line with what the gap was spent on: this process's CPU time
  and major page faults over the gap (waiting on the disk for code or mmapped weights the kernel had dropped), the
  CPU by thread (from /proc/self/task, so a thread burning the GIL is named), the machine's idle, iowait and steal
  time (a process that got no CPU on an idle box was blocked; one that got none on a busy box was crowded out or
  paging; steal means the VM itself was descheduled), and how many SIGCONTs it received (`sigcont=1`: it was
  stopped, by SIGSTOP or a freezer, and continued: nothing in the process was at fault). The kernel may hand the
  SIGCONT to any thread, which on a loaded box may run its handler after the loop has resumed, so the line waits
  (awaiting, `SIGCONT_WAIT_S` and as many looks as fit in it, longer on a starved box) for the count to move before it
  is written. A SIGCONT counts for the gap it ends by when its handler ran (after the gap's start), not by when the
  tick read the count: a stop that lands inside a tick, after it took its time, ends a gap the next tick measures.

A tick costs two small reads (/proc/self/stat and the first line of /proc/stat) on the serving loop; the per-thread
counts (one read per thread) are taken only every `threads_every_s`, so a stall line's thread figures cover the
gap plus up to that much before it, which the line says (`threads_over_s`).

The lag also goes to `tilepd_decode_loop_lag_seconds`, so a stall shows on the dashboard before it costs a request.

Why not faulthandler's `dump_traceback_later` (used before): its C thread reads the other threads' frames without
the GIL, while they run, and the loop's next re-arm (`cancel_dump_traceback_later`) waits, holding the GIL, for
that thread to finish writing. A node stopped past the timeout and continued (SIGSTOP, a freezer) resumes every
thread at once with the dump due: once its log ended inside the dump (`  File ` and nothing) and the node never
answered again. A write that blocks (a full log pipe) wedged the loop the same way, for good
(tests/runtime/test_stall_watch.py reproduces that one). The witness here takes `sys._current_frames()` under the
GIL (every other thread is parked at a GIL hand-off, so no frame changes under it), formats at most
`MAX_DUMP_FRAMES` frames per thread, and writes on its own thread; the loop never waits for it, so however the
write fares (slow, blocked), the loop keeps ticking. A thread that holds the GIL without end stops the witness
too: then the liveness watchdog (tilepd.runtime.liveness) restarts the node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import IO, Callable

log = logging.getLogger("tilepd.runtime")

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MAX_DUMP_FRAMES = 40  # per thread, innermost first, as faulthandler's 100 but shorter
# how long a stall line waits for a SIGCONT's count to move (see `StallWatch.run`), and how often it looks: at least
# SIGCONT_WAIT_S of wall time and as many looks as fit in it at SIGCONT_POLL_S (on a box whose cores are all taken the
# loop gets few of them in that time, and neither does the thread the kernel gave the signal to), at most
# SIGCONT_WAIT_MAX_FACTOR times SIGCONT_WAIT_S
SIGCONT_WAIT_S = 1.0
SIGCONT_POLL_S = 0.01
SIGCONT_WAIT_MAX_FACTOR = 10


def _stat_fields(raw: str) -> list[str]:
    """The fields of a /proc/.../stat line after its `(name)`, which may itself hold spaces or parentheses."""
    return raw[raw.rindex(")") + 2:].split()


def thread_cpu_seconds(task_dir: Path = Path("/proc/self/task")) -> dict[str, float]:
    """CPU seconds (user + system) by thread, keyed `name/tid`: a Python thread by its `threading` name (Python 3.11
    does not name the OS thread), any other (OpenMP, torch, UCX) by its OS name; empty where /proc is missing."""
    py_names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            raw = (task / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        tid = int(task.name)
        name = py_names.get(tid) or raw[raw.index("(") + 1: raw.rindex(")")]
        fields = _stat_fields(raw)
        # fields[11] and [12] are utime and stime (the 14th and 15th of proc(5), counted after the name)
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    return out


def machine_cpu_seconds(stat_file: Path = Path("/proc/stat")) -> dict[str, float]:
    """The whole machine's idle, iowait and steal CPU seconds since boot (all cores); empty where unreadable."""
    try:
        with stat_file.open() as f:
            first = f.readline().split()  # the all-cores line; the rest (per core, interrupts) is not read
    except OSError:
        return {}
    if not first or first[0] != "cpu" or len(first) < 9:
        return {}
    ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
    return {"idle": ticks[3] / _TICKS_PER_S, "iowait": ticks[4] / _TICKS_PER_S, "steal": ticks[7] / _TICKS_PER_S}


def process_cpu_and_faults(stat_file: Path = Path("/proc/self/stat")) -> tuple[float, int]:
    """This process's CPU seconds (user + system, every thread, ended ones too) and major page faults so far (pages
    it waited on the disk for: code or mmapped weights that the kernel had dropped from memory); zeros where /proc is
    missing."""
    try:
        fields = _stat_fields(stat_file.read_text())
    except OSError:
        return 0.0, 0
    # majflt, utime and stime: the 12th, 14th and 15th fields of proc(5), counted here after the name
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S, int(fields[9])


def _spent(before: dict[str, float], after: dict[str, float], *, keep_zero: bool = False) -> dict[str, float]:
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    return spent if keep_zero else {k: v for k, v in spent.items() if v > 0.0}


def describe_gap(gap_s: float, process_cpu_s: float, threads: dict[str, float], threads_over_s: float,
                 machine: dict[str, float], majflt: int = 0, sigcont: int = 0) -> str:
    """The `key=value` tail of one `event=loop_stall` line: the process over the gap, the threads that used CPU over
    `threads_over_s` (most first), then the machine over the gap."""
    busy = sorted(threads.items(), key=lambda kv: -kv[1])[:6]
    parts = [f"gap_s={gap_s:.2f}", f"process_cpu_s={process_cpu_s:.2f}",
             "threads=" + (",".join(f"{name.replace(' ', '_')}:{sec:.2f}" for name, sec in busy) or "none"),
             f"threads_over_s={threads_over_s:.2f}"]
    parts += [f"major_faults={majflt}", f"sigcont={sigcont}"]
    parts += [f"machine_{k}_s={v:.2f}" for k, v in machine.items()]
    return " ".join(parts)


def format_stacks(frames: dict[int, FrameType], current: int, after_s: float, max_frames: int = MAX_DUMP_FRAMES) -> str:
    """Every thread's stack in faulthandler's layout (`Timeout (h:mm:ss)!`, `Thread 0x...`, `  File "f", line n in
    fn`, innermost first), which log readers (tests/router/conftest.py) already parse."""
    secs = int(after_s)
    out = [f"Timeout ({secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d})!"]
    for ident, frame in frames.items():
        out.append(f"{'Current thread' if ident == current else 'Thread'} {ident:#018x} (most recent call first):")
        f: FrameType | None = frame
        n = 0
        while f is not None and n < max_frames:
            out.append(f'  File "{f.f_code.co_filename}", line {f.f_lineno} in {f.f_code.co_name}')
            f, n = f.f_back, n + 1
        if f is not None:
            out.append("  ...")
        out.append("")
    return "\n".join(out) + "\n"


class _StackWitness(threading.Thread):
    """Dumps every thread's stack once per stall when the loop has not ticked for `after_s` (see the module doc)."""

    def __init__(self, after_s: float, poll_s: float, out: IO[str]):
        super().__init__(name="stall-witness", daemon=True)
        self.after_s, self.poll_s, self.out = after_s, poll_s, out
        self.last_tick = time.monotonic()
        self.ticks = 0
        self.dumps = 0
        self._dumped_at_tick = -1
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.poll_s):
            ticks = self.ticks
            if ticks == self._dumped_at_tick or time.monotonic() - self.last_tick < self.after_s:
                continue
            self._dumped_at_tick = ticks
            text = format_stacks(sys._current_frames(), threading.get_ident(), self.after_s)
            self.dumps += 1
            try:
                self.out.write(text)
                self.out.flush()
            except (OSError, ValueError):  # a closed or broken log: the next stall tries again
                pass


class StallWatch:
    """Runs as a task on the node's event loop (see `run`); `on_tick` is called at every tick (the liveness
    heartbeat: a loop that stops ticking stops it)."""

    def __init__(self, node: str, *, tick_s: float = 0.5, warn_after_s: float = 2.0, dump_after_s: float = 5.0,
                 threads_every_s: float = 5.0, dump_file: IO[str] | None = None,
                 observe: Callable[[float], None] | None = None, on_tick: Callable[[], None] | None = None):
        self.node, self.tick_s, self.warn_after_s, self.dump_after_s = node, tick_s, warn_after_s, dump_after_s
        self.threads_every_s = threads_every_s
        self.dump_file = dump_file or sys.stderr
        self.observe = observe
        self.on_tick = on_tick
        self.witness: _StackWitness | None = None
        self.stalls = 0
        self.continued = 0  # SIGCONTs received: a process stopped and continued (SIGSTOP, a debugger, a freezer) knows it so
        self._continued_at: deque[float] = deque(maxlen=64)  # when their handlers ran (monotonic)

    def _on_sigcont(self, _signum: int, _frame: object) -> None:
        self._continued_at.append(time.monotonic())
        self.continued += 1

    def _continued_since(self, start: float) -> int:
        """SIGCONTs handled after `start` (list() copies the deque in one C call: no handler runs inside it)."""
        return sum(at > start for at in list(self._continued_at))

    async def run(self) -> None:
        (cpu, faults), machine, last = process_cpu_and_faults(), machine_cpu_seconds(), time.monotonic()
        threads, threads_at = thread_cpu_seconds(), last
        try:
            previous = signal.signal(signal.SIGCONT, self._on_sigcont)
        except ValueError:  # not the main thread: go without
            previous = None
        witness = self.witness = _StackWitness(self.dump_after_s, min(self.tick_s, self.dump_after_s / 4), self.dump_file)
        witness.start()

        def beat() -> None:
            witness.last_tick, witness.ticks = time.monotonic(), witness.ticks + 1
            if self.on_tick is not None:
                self.on_tick()

        try:
            while True:
                beat()
                await asyncio.sleep(self.tick_s)
                now = time.monotonic()
                lag = max(0.0, now - last - self.tick_s)
                if self.observe is not None:
                    self.observe(lag)
                (new_cpu, new_faults), new_machine = process_cpu_and_faults(), machine_cpu_seconds()
                if lag >= self.warn_after_s:
                    self.stalls += 1
                    new_threads = thread_cpu_seconds()
                    # a SIGCONT's Python handler runs on this thread, but only once the thread the kernel gave the
                    # signal to has run its C handler, which on a loaded box can come after this line: give it time
                    # (a stall without a SIGCONT waits the whole bound; the loop serves and beats meanwhile)
                    begun, looks, polls = time.monotonic(), 0, SIGCONT_WAIT_S / SIGCONT_POLL_S
                    try:
                        while not self._continued_since(last):
                            waited = time.monotonic() - begun
                            if (waited >= SIGCONT_WAIT_S and looks >= polls) or waited >= SIGCONT_WAIT_S * SIGCONT_WAIT_MAX_FACTOR:
                                break
                            await asyncio.sleep(SIGCONT_POLL_S)
                            looks += 1
                            beat()
                    finally:  # cancelled meanwhile (the node stops): the line is written all the same
                        # the stack dump names threads by ident only: the map lets a reader put names on it
                        idents = ",".join(f"{t.ident:#x}:{t.name.replace(' ', '_')}" for t in threading.enumerate() if t.ident)
                        log.warning("event=loop_stall node=%s %s thread_idents=%s", self.node,
                                    describe_gap(now - last, new_cpu - cpu, _spent(threads, new_threads), now - threads_at,
                                                 _spent(machine, new_machine, keep_zero=True), new_faults - faults,
                                                 self._continued_since(last)),
                                    idents)
                    threads, threads_at = new_threads, now
                    # the next gap starts here, not before the wait for a SIGCONT
                    (new_cpu, new_faults), new_machine, now = process_cpu_and_faults(), machine_cpu_seconds(), time.monotonic()
                elif now - threads_at >= self.threads_every_s:
                    threads, threads_at = thread_cpu_seconds(), now
                cpu, faults, machine, last = new_cpu, new_faults, new_machine, now
        finally:
            witness.stop.set()
            if previous is not None:
                signal.signal(signal.SIGCONT, previous)
