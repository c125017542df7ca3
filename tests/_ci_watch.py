"""What a CI run needs to be readable when it goes wrong: a suite budget, early failure lines,
and a snapshot of the machine when one test runs long.

CI stops the whole job at 90 minutes and then shows only part of what was printed; a run cut off
there says nothing about why. So: (1) every test's timeout is capped at what is left of the suite
budget (TILEPD_TEST_BUDGET_S, default 75 min: CI's 90 include the bootstrap), and once it is spent
the remaining tests fail at once, naming the budget, so pytest still ends with its summary; (2) a
failing test prints its reason the moment it fails, not only in the summary at the end; (3) a test
still running after TILEPD_TEST_WATCH_S (default 600 s) prints the load, CPU steal, memory and the
processes it started, which tells a stuck test from a starved machine.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator

import pytest

BUDGET_S = float(os.environ.get("TILEPD_TEST_BUDGET_S", 75 * 60))
WATCH_S = float(os.environ.get("TILEPD_TEST_WATCH_S", 600))
_started = time.monotonic()
_steal_at_start: int | None = None
_reporter = None  # pytest's terminal reporter, set in pytest_configure
_last_text: list[str] = []  # the last failure printed, so a fixture error repeated per test prints once


def _elapsed() -> str:
    s = int(time.monotonic() - _started)
    return f"{s // 60}m{s % 60:02d}s"


def _left_s() -> float:
    return BUDGET_S - (time.monotonic() - _started)


def _cpu_steal_ticks() -> int | None:
    try:
        fields = open("/proc/stat").readline().split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _started, _steal_at_start
    _started = time.monotonic()
    _steal_at_start = _cpu_steal_ticks()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: object) -> bool | None:
    """pytest-timeout's own timer, its timeout capped at what is left of the suite budget."""
    import pytest_timeout

    timeout = getattr(settings, "timeout", None)
    if not timeout:
        return None
    capped = max(1.0, min(float(timeout), _left_s()))
    if capped >= timeout:
        return None
    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=capped))  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _left_s() <= 0:
        pytest.fail(f"suite budget of {BUDGET_S:.0f} s (TILEPD_TEST_BUDGET_S) spent after {_elapsed()}: not run", pytrace=False)


def _snapshot(nodeid: str) -> str:
    lines = [f"[ci-watch {_elapsed()}] {nodeid} still running after {WATCH_S:.0f} s"]
    try:
        lines.append("  loadavg: " + open("/proc/loadavg").read().strip())
    except OSError:
        pass
    steal = _cpu_steal_ticks()
    if steal is not None and _steal_at_start is not None:
        lines.append(f"  cpu steal since the suite began: {(steal - _steal_at_start) / os.sysconf('SC_CLK_TCK'):.0f} s")
    try:
        import psutil

        vm = psutil.virtual_memory()
        lines.append(f"  memory: {vm.available >> 20} MiB available of {vm.total >> 20} MiB")
        for p in psutil.Process().children(recursive=True):
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cmd = " ".join(p.cmdline())[:140]
                    lines.append(f"  pid {p.pid} {p.status()} cpu {t.user + t.system:.0f}s rss {p.memory_info().rss >> 20}MiB: {cmd}")
            except psutil.Error:
                continue
    except ImportError:
        pass
    return "\n".join(lines)


def _report_long_test(item: pytest.Item) -> None:
    """Runs on a timer thread: capture is suspended for the write so that it reaches the CI log now."""
    text = _snapshot(item.nodeid)
    capman = item.config.pluginmanager.get_plugin("capturemanager")
    if capman is None or _reporter is None:
        print(text, file=sys.stderr, flush=True)
        return
    with capman.global_and_fixture_disabled():
        _reporter.write_line("")
        for line in text.splitlines():
            _reporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    timer = threading.Timer(WATCH_S, _report_long_test, (item,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    global _last_text
    if _reporter is None:
        return
    text = report.longreprtext.strip().splitlines()
    _reporter.write_line("")
    _reporter.write_line(f"[{_elapsed()}] {report.nodeid} failed in {report.when} ({report.duration:.0f} s):")
    if text == _last_text:  # a module fixture's error repeats for every test that uses it
        _reporter.write_line("    (the same error as above)")
        return
    _last_text = text
    for line in text[-12:]:
        _reporter.write_line("    " + line[:300])


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    global _reporter
    _reporter = config.pluginmanager.get_plugin("terminalreporter")
