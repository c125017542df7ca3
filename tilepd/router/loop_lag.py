"""How long the router's own event loop was held up, so that a timeout it measured can be judged.

A health probe or a liveness wait that timed out says the node did not answer only if the router was running to
hear it. When the router itself got no CPU (a host whose cores other processes hold, a VM descheduled, a paused
process), every timer it had fires at once when it runs again: each probe it had out times out, each wait looks
long, and healthy nodes would be taken out of rotation for the router's own stall (on the 2-core test host
sleeping processes were seen to get no CPU for 15-29 s while both cores were busy; a router among them would have
called every node it had a probe out to dead the moment it ran again).
Failure detectors that must survive their own pauses do the same (pause detection: a timeout measured across the
detector's pause is not held against the peer).

A tick every `tick_s` notes each hold-up longer than `threshold_s` (one of LOGGED_STALL_S or more is logged, a
warning: it explains a lease the router let lapse, a probe it did not judge); `stalled_s(since)` says how much of the time
since an instant the loop spent held up, counting one still under way (a tick that has not run yet).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

log = logging.getLogger("tilepd.router")

# a probe or wait that timed out is not held against the node when the router was itself held up this share of it
INCONCLUSIVE_SHARE = 0.25
LOGGED_STALL_S = 2.0


class LoopLag:
    """Runs as a task on the router's loop (`run`); read from the same loop."""

    def __init__(self, *, tick_s: float = 0.1, threshold_s: float = 0.25, keep: int = 256) -> None:
        self.tick_s, self.threshold_s = tick_s, threshold_s
        self._last = time.monotonic()
        self._stalls: deque[tuple[float, float]] = deque(maxlen=keep)  # (from, to) on the monotonic clock

    async def run(self) -> None:
        self._last = time.monotonic()
        while True:
            await asyncio.sleep(self.tick_s)
            self.note(time.monotonic())

    def note(self, now: float) -> None:
        """A tick ran at `now`: a hold-up since the one before is kept."""
        due = self._last + self.tick_s
        if now - due >= self.threshold_s:
            self._stalls.append((due, now))
            if now - due >= LOGGED_STALL_S:
                log.warning("event=router_loop_stalled held_up_s=%.2f (this router got no CPU, or its loop was blocked)", now - due)
        self._last = now

    def stalled_s(self, since: float, now: float | None = None) -> float:
        """Seconds of hold-up of this loop after `since` (monotonic), including one still under way."""
        now = time.monotonic() if now is None else now
        total = sum(end - max(start, since) for start, end in self._stalls if end > since)
        due = self._last + self.tick_s
        if now - due >= self.threshold_s:  # the tick that would note it has not run yet
            total += now - max(due, since)
        return total

    def judges(self, since: float, window_s: float, now: float | None = None) -> bool:
        """Whether a timeout of `window_s` that began at `since` can be held against the peer: the loop was running
        for most of it."""
        return self.stalled_s(since, now) < INCONCLUSIVE_SHARE * window_s
