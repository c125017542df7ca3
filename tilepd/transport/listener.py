"""Listening sockets of the decode node's control and tcp data ports: an accept loop that outlives accept errors,
and stopping a listener whose accept() runs on a thread.

`accept()` fails for reasons that pass: no fd left (EMFILE, ENFILE), no buffer memory (ENOBUFS, ENOMEM). A loop
that returned on the first such error left its port dead for good while the node's `/health` said 200. Here an
accept error is retried after a backoff (doubling from `BACKOFF_MIN_S` to `BACKOFF_MAX_S`), logged once when it
starts and every `LOG_EVERY_S` while it lasts, with the runbook id, and `problem()` says so until an accept
succeeds again, so `/health` fails and the router takes the node out of rotation meanwhile.

A listener also caps its connections: past `max_connections` a new connection is handed to `on_full` (which may
answer why) and closed, so a flood of connections costs the node no thread.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Callable

from tilepd.runbooks import tag

log = logging.getLogger("tilepd.transport.listener")

BACKOFF_MIN_S = 0.01
BACKOFF_MAX_S = 1.0
LOG_EVERY_S = 10.0
# the peer went away between the kernel's handshake and accept(): nothing is wrong with the listener
_PEER_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})

Addr = tuple[str, int]


class Listener:
    """Accepts on `sock` on its own thread and hands each connection to `on_accept` (on that thread: it must not
    block); `active()` counts the connections the owner still serves, for the cap."""

    def __init__(self, name: str, sock: socket.socket, on_accept: Callable[[socket.socket, Addr], None], *,
                 active: Callable[[], int], max_connections: int,
                 on_full: Callable[[socket.socket, Addr], None] | None = None):
        self.name, self._sock, self._on_accept = name, sock, on_accept
        self._active, self.max_connections, self._on_full = active, max_connections, on_full
        self.port: int = sock.getsockname()[1]
        self._closed = False
        self._failing_since: float | None = None
        self._last_error = ""
        self.accept_errors = 0
        self.refused_full = 0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-accept", daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        stop_listener(self._sock, self._thread if self._thread.is_alive() else None)

    def problem(self) -> str | None:
        """Why this listener takes no connection now (its thread ended, or accept keeps failing), or None."""
        if self._closed:
            return f"{self.name} listener on port {self.port} is closed"
        if not self._thread.is_alive():
            return f"{self.name} listener on port {self.port}: its accept thread ended"
        since = self._failing_since
        if since is not None:
            return f"{self.name} listener on port {self.port}: accept failing for {time.monotonic() - since:.1f} s ({self._last_error})"
        return None

    def _loop(self) -> None:
        backoff, last_log = BACKOFF_MIN_S, 0.0
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in _PEER_GONE:
                    continue
                now = time.monotonic()
                self.accept_errors += 1
                self._last_error = f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror or exc}"
                if self._failing_since is None:
                    self._failing_since = now
                if now - last_log >= LOG_EVERY_S:
                    last_log = now
                    log.error("event=accept_failed listener=%s port=%d errno=%s retry_in_s=%.2f failing_s=%.1f %s error=%s",
                              self.name, self.port, errno.errorcode.get(exc.errno or 0, exc.errno), backoff,
                              now - self._failing_since, tag("RB-accept-failing"), exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            if self._failing_since is not None:
                log.warning("event=accept_recovered listener=%s port=%d failing_s=%.1f errors=%d", self.name, self.port,
                            time.monotonic() - self._failing_since, self.accept_errors)
                self._failing_since, backoff, last_log = None, BACKOFF_MIN_S, 0.0
            if self._active() >= self.max_connections:
                self.refused_full += 1
                log.warning("event=conn_refused listener=%s peer=%s reason=too_many_connections max_connections=%d",
                            self.name, addr[0], self.max_connections)
                try:
                    if self._on_full is not None:
                        self._on_full(sock, addr)
                except OSError:
                    pass
                sock.close()
                continue
            try:
                self._on_accept(sock, addr)
            except Exception as exc:  # noqa: BLE001 - one connection's setup must not end the loop
                log.warning("event=conn_setup_failed listener=%s peer=%s error=%r", self.name, addr[0], exc)
                try:
                    sock.close()
                except OSError:
                    pass


def stop_listener(listener: socket.socket, accept_thread: threading.Thread | None, timeout_s: float = 1.0) -> None:
    """Close a listening socket so that a thread blocked in accept() returns.

    On Linux close() alone leaves accept() blocked forever (the thread leaks);
    shutdown() on the listener wakes it with an error, then the thread is joined.
    """
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        listener.close()
    except OSError:
        pass
    if accept_thread is not None and accept_thread is not threading.current_thread():
        accept_thread.join(timeout_s)
