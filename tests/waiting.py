"""Polling with a deadline, for tests that wait on another process (a log line, a probe, a state change)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    """Poll `check` every `interval_s` until it holds or `timeout_s` passes; True when it held. It is asked once more
    at the deadline, so a state reached during the last sleep still counts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval_s)
    return check()
