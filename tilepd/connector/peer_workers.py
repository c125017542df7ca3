"""One worker thread per decode node for the connector's sends.

Why: a send blocks until the decode node answers (hello, admit, done: up to
`sender.REPLY_TIMEOUT_S` each) or the write ends. With one sender thread for all
nodes, a stopped (SIGSTOP) or hung node held every other node's transfer behind it
for that long, and their reserved slots timed out. Here each node has its own FIFO
and thread: a stalled node delays only its own transfers. Jobs for one node still run
one at a time, in order (a decode node takes one transfer at a time anyway).

A node's thread exists only while it has work: it exits when its queue is empty, so
idle nodes cost nothing and the number of threads is bounded by the busy nodes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Hashable

log = logging.getLogger("tilepd.connector")


class PeerWorkers:
    """Run submitted jobs in order per key, concurrently across keys."""

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._queues: dict[Hashable, deque[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        self._threads: dict[Hashable, threading.Thread] = {}
        self._closed = False

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)` behind the jobs already queued for `key`."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after close")
            self._queues.setdefault(key, deque()).append((fn, args))
            if key not in self._threads:
                t = threading.Thread(target=self._run, args=(key,), name=f"{self._name}-{_label(key)}", daemon=True)
                self._threads[key] = t
                t.start()

    def pending(self) -> dict[Hashable, int]:
        """Jobs not yet finished per key (queued plus the running one)."""
        with self._cond:
            return {k: len(q) for k, q in self._queues.items() if q}

    def close(self, timeout: float) -> bool:
        """Refuse new jobs and wait up to `timeout` s for the queued ones; False if some are still running."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: not self._threads, max(0.0, deadline - time.monotonic()))

    def _run(self, key: Hashable) -> None:
        while True:
            with self._cond:
                q = self._queues[key]
                if not q:
                    del self._queues[key], self._threads[key]
                    self._cond.notify_all()
                    return
                fn, args = q[0]  # left in the queue while it runs: pending() counts it
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one job's failure must not stop the node's later jobs
                log.exception("tilepd-connector event=worker_job_failed peer=%s", _label(key))
            finally:
                with self._cond:
                    q.popleft()


def _label(key: Hashable) -> str:
    return ":".join(map(str, key)) if isinstance(key, tuple) else str(key)
