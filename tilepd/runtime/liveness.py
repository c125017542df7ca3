"""The serving loop's liveness, told to systemd: `READY=1` once the node serves, `WATCHDOG=1` from the loop's tick.

A unit with `Type=notify` and `WatchdogSec=` (plan/systemd.py) is restarted by systemd when the pings stop: a loop
that is blocked, or a process wedged in any other way, pings no more, whatever its threads still do. The pings
come from the stall watch's tick on the event loop itself (tilepd.runtime.stall_watch), not from a thread of their
own, so a thread that would go on pinging while the loop is stuck cannot hide it.

sd_notify(3) is one datagram to the AF_UNIX socket named by `NOTIFY_SOCKET` (a path, or `@name` in the abstract
namespace); the socket is opened once at start, so a node out of fds still pings. Without `NOTIFY_SOCKET` (process
mode, tests) nothing is sent.

`TILEPD_FAULT_WEDGE_LOOP_AFTER_S` (test only: the fault tests set it; nothing in a deployment does) blocks the
node's event loop for good that many seconds after the loop starts (the node then serves a few seconds): a wedge on demand, which the real node
cannot be made to produce from outside (SIGSTOP stops every thread, which is another fault).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, Mapping

log = logging.getLogger("tilepd.runtime")

WEDGE_ENV = "TILEPD_FAULT_WEDGE_LOOP_AFTER_S"


class SdNotifier:
    """sd_notify(3) over the socket `NOTIFY_SOCKET` names; `send` returns False when there is none or it fails."""

    def __init__(self, env: Mapping[str, str] = os.environ):
        path = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        self._sock: socket.socket | None = None
        if path.startswith("@"):
            self.address = "\0" + path[1:]
        elif path.startswith("/"):
            self.address = path
        elif path:
            log.warning("event=sd_notify_unsupported notify_socket=%s (only unix socket paths and @abstract names)", path)
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s: float | None = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self.failures = 0

    def send(self, message: str) -> bool:
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto(message.encode(), self.address)
            return True
        except OSError as exc:  # systemd gone or its queue full: the next tick tries again
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("event=sd_notify_failed message=%s failures=%d error=%s", message.split("=")[0], self.failures, exc)
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Liveness:
    """Called at every tick of the serving loop: READY=1 once `serving()` is true, then WATCHDOG=1 every quarter of
    the watchdog interval systemd set (`WATCHDOG_USEC`)."""

    def __init__(self, node: str, serving: Callable[[], bool], notifier: SdNotifier | None = None):
        self.node, self.serving = node, serving
        self.notifier = notifier or SdNotifier()
        self.ready_sent = False
        self.pings = 0
        self._last_ping = 0.0

    def tick(self) -> None:
        if not self.ready_sent:
            if not self.serving():
                return
            if self.notifier.send("READY=1\nSTATUS=serving"):  # a datagram that did not go is sent again next tick
                self.ready_sent = True
                log.info("event=sd_ready node=%s watchdog_s=%s", self.node, self.notifier.watchdog_s)
        every = self.notifier.watchdog_s
        now = time.monotonic()
        if every is not None and now - self._last_ping >= every / 4:
            self._last_ping = now
            if self.notifier.send("WATCHDOG=1"):
                self.pings += 1


def wedge_after_s(env: Mapping[str, str] = os.environ) -> float | None:
    """The test-only wedge's delay (see the module doc), or None."""
    raw = env.get(WEDGE_ENV)
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"{WEDGE_ENV}={raw!r} is not a number of seconds") from exc


def wedge_forever(node: str) -> None:
    """Blocks the calling thread (the event loop) for good: the test-only fault."""
    log.warning("event=fault_injected node=%s fault=wedge_loop env=%s", node, WEDGE_ENV)
    while True:
        time.sleep(3600)
