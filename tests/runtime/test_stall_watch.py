"""The stall witness of a decode node: a blocked event loop is logged with where the time went, and the stacks of
every thread are dumped while it is still blocked."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tilepd.runtime.stall_watch import StallWatch, describe_gap, machine_cpu_seconds, process_cpu_and_faults, thread_cpu_seconds


def _spin(cpu_seconds: float) -> None:
    """Burn this much CPU on the calling thread (counted in CPU time: on a loaded box wall time would say little)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_is_counted_by_thread_name() -> None:
    release = threading.Event()

    def spin_then_wait() -> None:
        _spin(0.05)
        release.wait(60)

    th = threading.Thread(target=spin_then_wait, name="spinner")
    before = thread_cpu_seconds()
    th.start()
    try:
        during = thread_cpu_seconds()  # the thread is alive until released, whatever the box's load
    finally:
        release.set()
        th.join()
    assert f"spinner/{th.native_id}" in during, sorted(during)
    assert f"MainThread/{threading.main_thread().native_id}" in during, sorted(during)
    assert sum(during.values()) >= sum(before.values())
    assert set(machine_cpu_seconds()) == {"idle", "iowait", "steal"}
    cpu, faults = process_cpu_and_faults()
    assert cpu >= sum(during.values()) - 0.05 and faults >= 0, (cpu, during)  # the process counts every thread (and ended ones)
    assert process_cpu_and_faults(Path("/nonexistent")) == (0.0, 0)


def test_gap_description_names_the_busiest_threads_first() -> None:
    line = describe_gap(21.0, 19.62, {"engine_0/12": 0.1, "grammar-warmup/14": 19.5}, 23.5, {"idle": 0.0, "iowait": 0.0, "steal": 0.0}, 7, 1)
    assert line.startswith("gap_s=21.00 process_cpu_s=19.62 threads=grammar-warmup/14:19.50,engine_0/12:0.10 threads_over_s=23.50"), line
    assert "major_faults=7 sigcont=1 " in line and "machine_steal_s=0.00" in line


async def _watched(block, tmp_path: Path) -> tuple[StallWatch, str]:
    lags: list[float] = []
    with open(tmp_path / "dump.txt", "w") as dump:
        watch = StallWatch("n0", tick_s=0.1, warn_after_s=0.8, dump_after_s=1.0, threads_every_s=0.3, dump_file=dump,
                           observe=lags.append)
        task = asyncio.get_running_loop().create_task(watch.run())
        await asyncio.sleep(0.35)
        block()  # on the loop's own thread: the loop answers nothing meanwhile
        await asyncio.sleep(0.35)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert max(lags) >= 1.1, lags
    return watch, (tmp_path / "dump.txt").read_text()


def _longest_stall(caplog: pytest.LogCaptureFixture, watch: StallWatch) -> str:
    """The line of the stall the test caused: on a loaded box the loop may also stall a little by itself."""
    lines = [r.getMessage() for r in caplog.records if "event=loop_stall" in r.getMessage()]
    assert lines and watch.stalls == len(lines), lines
    return max(lines, key=lambda line: float(line.split("gap_s=")[1].split()[0]))


@pytest.mark.parametrize("how", ["spinning", "sleeping"])
def test_a_blocked_loop_is_logged_and_its_stacks_dumped(how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def block_the_loop_spinning() -> None:
        _spin(1.3)  # at least 1.3 s of wall time too

    def block_the_loop_sleeping() -> None:
        # 1.5 s past the dump's 1 s: faulthandler's own thread must get the CPU before the loop re-arms it
        time.sleep(2.5)

    block = block_the_loop_spinning if how == "spinning" else block_the_loop_sleeping
    with caplog.at_level(logging.WARNING, logger="tilepd.runtime"):
        watch, dump = asyncio.run(_watched(block, tmp_path))
    line = _longest_stall(caplog, watch)
    fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    assert fields["node"] == "n0" and float(fields["gap_s"]) >= 1.3 and int(fields["major_faults"]) >= 0, line
    assert f"{threading.main_thread().ident:#x}:MainThread" in fields["thread_idents"], line
    cpu = float(fields["process_cpu_s"])
    # spinning: the loop's thread burned the gap (named first); sleeping: the process used next to no CPU
    assert (cpu >= 1.0 and fields["threads"].startswith("MainThread/")) if how == "spinning" else cpu < 0.5, line
    assert fields["sigcont"] == "0", line
    # the per-thread figures are refreshed every 0.3 s between stalls: they cover the gap and at most a little before
    # (a refresh is due 0.3 s after the last; the tick taking it may itself be late by up to the 0.8 s warning bound)
    assert float(fields["gap_s"]) - 0.01 <= float(fields["threads_over_s"]) <= float(fields["gap_s"]) + 0.3 + 0.8 + 0.1, line
    # faulthandler wrote the stacks while the loop was still blocked, naming the blocking function
    assert "Timeout (0:00:01)!" in dump and f"block_the_loop_{how}" in dump, dump


def test_a_stop_and_continue_is_told_apart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process stopped and continued (SIGSTOP then SIGCONT, as a debugger, a freezer or a test does) says so on the
    stall line: the gap was not its own doing. The stop is real: a child sends both signals to this process."""
    import subprocess
    import sys

    def stopped_from_outside() -> None:
        pid = os.getpid()
        # the continue is in a `finally`: this test process must never be left stopped
        subprocess.run([sys.executable, "-c", f"import os, signal, time\ntry:\n    os.kill({pid}, signal.SIGSTOP); time.sleep(1.6)\n"
                        f"finally:\n    os.kill({pid}, signal.SIGCONT)"], check=True, timeout=60)

    with caplog.at_level(logging.WARNING, logger="tilepd.runtime"):
        watch, _ = asyncio.run(_watched(stopped_from_outside, tmp_path))
    line = _longest_stall(caplog, watch)
    assert " sigcont=1 " in line and watch.continued == 1, line


_BLOCKED_LOG = """
import asyncio, fcntl, os, sys, time
from tilepd.runtime.stall_watch import StallWatch

r, w = os.pipe()  # the log pipe's reader never reads: fill it, so the next write blocks, as a stopped reader's does
fcntl.fcntl(w, fcntl.F_SETFL, os.O_NONBLOCK)
try:
    while True:
        os.write(w, b"x" * 65536)
except BlockingIOError:
    pass
fcntl.fcntl(w, fcntl.F_SETFL, 0)
full = os.fdopen(w, "w")

async def main():
    watch = StallWatch("n0", tick_s=0.05, warn_after_s=10, dump_after_s=0.3, dump_file=full)
    task = asyncio.get_running_loop().create_task(watch.run())
    await asyncio.sleep(0.2)
    time.sleep(1.0)  # the loop blocked past dump_after_s: the stack dump is due, and its write will block
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 2.0:
        await asyncio.sleep(0.05)
        n += 1
    print(f"loop_iterations={n}", flush=True)
    os._exit(0)

asyncio.run(main())
"""


def test_a_blocked_log_cannot_wedge_the_loop(tmp_path: Path) -> None:
    """The stack dump's write blocks for good (a full pipe nobody reads, as a stopped log reader leaves it): the
    loop goes on ticking. With faulthandler's dump_traceback_later the loop's next re-arm waited, holding the GIL,
    for the blocked dump: the whole process wedged (this test's child then never printed and was killed)."""
    import subprocess
    import sys

    script = tmp_path / "blocked_log.py"
    script.write_text(_BLOCKED_LOG)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the process wedged: its loop never came back from the blocked stack dump")
    assert out.returncode == 0, out.stderr[-2000:]
    n = int(out.stdout.split("loop_iterations=")[1])
    assert n >= 10, out.stdout  # 2 s of 50 ms sleeps: ~40 on a quiet box; a wedged loop makes none


def test_a_sigcont_handled_after_the_loop_resumed_is_still_counted(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The kernel hands a SIGCONT to any thread of the process; on a loaded box the one that got it may run its
    handler after the loop has resumed, and the stall line then said `sigcont=0` for a node that was stopped and
    continued. The line waits for the count: here the SIGCONT is sent (a real one, to this process) 0.2 s after the
    blocked loop resumed. A stall without one waits out the bound, and that wait is not counted into the next gap."""
    from tilepd.runtime import stall_watch

    seen: list[tuple[float, int]] = []  # (lag, stalls begun before it)

    def gap(line: str) -> float:
        return float(line.split("gap_s=")[1].split()[0])

    async def main() -> tuple[StallWatch, list[str], int]:
        watch = StallWatch("n0", tick_s=0.05, warn_after_s=1.0, dump_after_s=30.0,
                           observe=lambda lag: seen.append((lag, watch.stalls)))
        task = asyncio.get_running_loop().create_task(watch.run())

        async def stall_line(start: int) -> tuple[str, int]:
            """The first stall line from the `start`th on that is the test's own (the box may stall the loop too)."""
            t0 = time.monotonic()
            while True:
                lines = [r.getMessage() for r in caplog.records if "event=loop_stall" in r.getMessage()][start:]
                mine = [line for line in lines if gap(line) >= 1.5]
                if mine:
                    return mine[0], watch.stalls
                assert time.monotonic() - t0 < 30, f"no stall line: {lines}"
                await asyncio.sleep(0.02)

        def logged() -> int:
            return sum("event=loop_stall" in r.getMessage() for r in caplog.records)

        await asyncio.sleep(0.2)
        monkeypatch.setattr(stall_watch, "SIGCONT_WAIT_S", 30.0)  # the test's own bound: the count moves long before
        start = logged()
        time.sleep(1.6)  # the stall, on the loop's own thread; the SIGCONT comes after it
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGCONT)).start()
        continued, _ = await stall_line(start)
        monkeypatch.setattr(stall_watch, "SIGCONT_WAIT_S", 2.0)
        start = logged()
        time.sleep(1.6)  # a stall without a SIGCONT: its line comes after the whole 2 s
        plain, number = await stall_line(start)
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return watch, [continued, plain], number

    with caplog.at_level(logging.WARNING, logger="tilepd.runtime"):
        watch, (continued, plain), number = asyncio.run(main())
    assert watch.continued == 1 and " sigcont=1 " in continued and " sigcont=0 " in plain, (continued, plain)
    # the tick after the second line measures its gap from the line, not from before the 2 s wait for a SIGCONT
    after = [lag for lag, stalls in seen if stalls == number]
    assert after and after[0] < 1.5, (number, seen)


def test_a_stop_inside_a_tick_counts_for_the_gap_it_ends(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stop that lands inside a tick, after the tick took its time (the /proc reads take longest on a starved box),
    ends a gap that only the next tick measures; its SIGCONT's handler ran inside the first tick. Read as a count at
    the tick's end, that SIGCONT went to the gap before it and the stall line said `sigcont=0` (a fresh-clone run's
    test_liveness on a saturated box, twice). Fault injected here: the tick's /proc read blocks the loop's thread for
    1.6 s (standing for the stop, which the loop sees the same way) while a real SIGCONT comes to this process."""
    from tilepd.runtime import stall_watch

    real = stall_watch.process_cpu_and_faults
    armed = {"now": False}

    def reads_then_stopped() -> tuple[float, int]:
        out = real()
        if armed["now"]:
            armed["now"] = False
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGCONT)).start()
            time.sleep(1.6)  # the "stop": the handler runs in here, when the SIGCONT comes
        return out

    monkeypatch.setattr(stall_watch, "process_cpu_and_faults", reads_then_stopped)
    monkeypatch.setattr(stall_watch, "SIGCONT_WAIT_S", 30.0)  # a miscounted SIGCONT would hold the line 30 s, then say 0

    async def main() -> tuple[StallWatch, str, float]:
        watch = StallWatch("n0", tick_s=0.05, warn_after_s=1.0, dump_after_s=30.0)
        task = asyncio.get_running_loop().create_task(watch.run())
        await asyncio.sleep(0.3)
        armed["now"] = True
        t0 = time.monotonic()
        while True:
            lines = [r.getMessage() for r in caplog.records if "event=loop_stall" in r.getMessage()]
            mine = [line for line in lines if float(line.split("gap_s=")[1].split()[0]) >= 1.5]
            if mine:
                break
            assert time.monotonic() - t0 < 20, f"no stall line within 20 s (the SIGCONT was not counted for its gap): {lines}"
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return watch, mine[0], took

    with caplog.at_level(logging.WARNING, logger="tilepd.runtime"):
        watch, line, took = asyncio.run(main())
    assert watch.continued == 1 and " sigcont=1 " in line, line
    assert took < 10, took  # the line came at the tick after the gap, with no wait for a count that had already moved
