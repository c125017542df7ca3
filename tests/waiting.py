"""Polling with a deadline, for tests that wait on another process (a log line, a probe, a state change)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll `check` every 50 ms until it holds or `timeout_s` passes; True when it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False
