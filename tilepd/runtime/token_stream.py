"""Tokens from the engine thread to the node's HTTP stream, as NDJSON chunks.

The engine calls `push` between two decode steps, so whatever it costs is paid once per token on the
engine thread. Here it is a deque append, plus one `call_soon_threadsafe` (a syscall that wakes the
event loop) only when the stream's reader is waiting for it. The reader (`get`, on the event loop)
takes every line pushed since its last read as one chunk: one loop round trip and one socket write per
chunk, not per token. A GPU step's token still leaves alone and at once (the reader waits between
steps); tokens that come faster than the loop serves them (CPU engines, a speculative step's accepted
tokens) are coalesced instead of each costing a wake-up, a task switch and a write
(bench/served_decode.py measures the host work per token).
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from typing import Any

_END = object()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():  # the reader may have been cancelled (client gone)
        fut.set_result(None)


def ndjson_line(item: Any) -> bytes:
    """One stream line: a token id as {"token": id}, or a dict (a token with its logprobs) as JSON."""
    if type(item) is int:
        return b'{"token": %d}\n' % item  # what json.dumps({"token": item}) writes, without building a dict
    return (json.dumps(item) + "\n").encode()


class TokenStream:
    """A one-producer (the engine thread), one-consumer (the stream coroutine) channel.

    `get()` answers ("token", bytes of one or more NDJSON lines) while lines come, then ("end", None)
    once `close()` was called and everything before it was read (the queue protocol http_api reads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()  # orders the reader's "empty, so wait" against the producer's "wake it"
        self._waiter: asyncio.Future | None = None
        self._ended = False

    def push(self, item: Any) -> None:
        """Any thread: a token id or a JSON-able dict."""
        self._items.append(item)
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    def close(self) -> None:
        """No more lines (any thread); the reader gets ("end", None) after the last one."""
        self.push(_END)

    async def get(self) -> tuple[str, bytes | None]:
        items = self._items
        while not self._ended:
            with self._lock:
                fut = None
                if not items:
                    fut = self._waiter = self._loop.create_future()
            if fut is not None:
                await fut
                continue
            parts: list[bytes] = []
            while items:
                item = items.popleft()
                if item is _END:
                    self._ended = True
                    break
                parts.append(ndjson_line(item))
            if parts:
                return "token", b"".join(parts)
        return "end", None
