"""Test-only faults the real node cannot be made to show from outside, read from the environment once.

`TILEPD_FAULT_DECODE_TOKEN_S` (test only: nothing in a deployment sets it) holds the engine's worker thread that
many seconds after each generated token: a slow accelerator on demand, so a test that needs a decode still running
when something happens to it (a client leaving mid-stream) creates that condition instead of hoping the machine is
slow. The wedge of the serving loop is the other such fault (`tilepd.runtime.liveness.WEDGE_ENV`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Mapping

log = logging.getLogger("tilepd.runtime")

SLOW_TOKEN_ENV = "TILEPD_FAULT_DECODE_TOKEN_S"


def slow_token_delay(env: Mapping[str, str] = os.environ) -> float:
    """The per-token hold the environment asks for (0.0: none); a value that is not a number >= 0 is refused."""
    raw = env.get(SLOW_TOKEN_ENV, "")
    if not raw:
        return 0.0
    try:
        delay = float(raw)
    except ValueError:
        raise ValueError(f"{SLOW_TOKEN_ENV}={raw!r}: not a number of seconds") from None
    if not 0.0 <= delay <= 10.0:
        raise ValueError(f"{SLOW_TOKEN_ENV}={raw!r}: must be between 0 and 10 seconds")
    log.warning("event=fault_injected fault=slow_decode token_s=%s (test only)", delay)
    return delay


def slowed(on_token: Callable[[int], None], delay_s: float) -> Callable[[int], None]:
    """`on_token`, then a sleep of `delay_s` on the engine's thread (so the next step starts that much later)."""
    if delay_s <= 0.0:
        return on_token

    def held(token: int) -> None:
        on_token(token)
        time.sleep(delay_s)

    return held
