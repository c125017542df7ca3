"""Stopping a listening socket whose accept() runs on a thread: the TCP transport's receiver and the decode node's
control server both listen that way."""

from __future__ import annotations

import socket
import threading


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
