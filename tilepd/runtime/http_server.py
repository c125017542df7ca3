"""The decode node's HTTP server: uvicorn with every connection bounded in time and size, and a liveness view.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) but not one that is reading a request: a peer
that sends half a request line and stalls holds its connection (and an fd) forever. Here a request, headers and
body, must arrive within `REQUEST_READ_TIMEOUT_S` of its first byte (of the accept, for a connection's first
request), headers within `MAX_HEADER_BYTES` and the whole request within `MAX_REQUEST_BYTES`; past either the
connection is closed with one `event=http_read_bounded` line. `MAX_HTTP_CONNECTIONS` caps the connections (past
it uvicorn answers 503).

`HttpListener` tells `/health` when the HTTP port takes no connection: asyncio's accept loop reports running out
of fds or buffers through the loop's exception handler (and retries a second later), which is recorded here.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tilepd.runbooks import tag

log = logging.getLogger("tilepd.runtime.http")

REQUEST_READ_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0  # the router's pool lets a connection go after 3 s (router/upstream.py KEEPALIVE_S): it closes first
MAX_HEADER_BYTES = 64 << 10
MAX_REQUEST_BYTES = 4 << 20  # the largest body the node takes is a 1 MiB structured_output spec
MAX_HTTP_CONNECTIONS = 512
_ACCEPT_EXHAUSTED = "socket.accept() out of system resource"
_FAILING_FOR_S = 2.5  # asyncio retries a failed accept after 1 s: a failure this recent means it is still failing


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size cap on reading each request."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_bytes = 0
        self._in_headers = False
        self._start_read()

    def _start_read(self) -> None:
        self._read_bytes, self._in_headers = 0, True
        self._read_timer = self.loop.call_later(REQUEST_READ_TIMEOUT_S, self._bounded, "read_timeout")

    def _stop_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._in_headers = False

    def _bounded(self, why: str) -> None:
        self._stop_read()
        peer = "%s:%d" % self.client if self.client else "?"
        log.warning("event=http_read_bounded peer=%s why=%s bytes=%d timeout_s=%.0f max_header_bytes=%d", peer, why,
                    self._read_bytes, REQUEST_READ_TIMEOUT_S, MAX_HEADER_BYTES)
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None:
            self._start_read()
        self._read_bytes += len(data)
        if self._read_bytes > MAX_REQUEST_BYTES:
            self._bounded("request_too_large")
            return
        super().data_received(data)
        if self._in_headers and self._read_bytes > MAX_HEADER_BYTES:
            self._bounded("headers_too_large")

    def on_headers_complete(self) -> None:
        self._in_headers = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._stop_read()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read()
        super().connection_lost(exc)


class HttpListener:
    """The HTTP port's liveness: the uvicorn server serving, and no recent accept failure."""

    def __init__(self, server: uvicorn.Server, port: int):
        self.server, self.port = server, port
        self.failed_at: float | None = None
        self.last_error = ""
        self.accept_errors = 0

    def on_loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The loop's exception handler: records an accept that ran out of fds or buffers, passes the rest on."""
        if context.get("message") != _ACCEPT_EXHAUSTED:
            loop.default_exception_handler(context)
            return
        exc = context.get("exception")
        code = errno.errorcode.get(getattr(exc, "errno", 0) or 0, "?")
        now = time.monotonic()
        if self.failed_at is None or now - self.failed_at > 10.0:  # one line when it starts, then every 10 s
            log.error("event=accept_failed listener=http port=%d errno=%s retry_in_s=1.00 %s error=%s", self.port, code,
                      tag("RB-accept-failing"), exc)
        self.failed_at, self.last_error = now, f"{code}: {getattr(exc, 'strerror', exc)}"
        self.accept_errors += 1

    def problem(self) -> str | None:
        if not self.server.started:
            return None  # not yet serving: /health is not reachable either
        servers = getattr(self.server, "servers", [])
        if not servers or not all(s.is_serving() for s in servers):
            return f"http listener on port {self.port} is not serving"
        if self.failed_at is not None and time.monotonic() - self.failed_at < _FAILING_FOR_S:
            return f"http listener on port {self.port}: accept failing ({self.last_error})"
        return None


def http_server(app: Any, host: str, port: int) -> tuple[uvicorn.Server, HttpListener]:
    """The node's uvicorn server (run it with `.run()`) and the listener view `/health` reads."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, http=BoundedHttpProtocol,
                            timeout_keep_alive=int(KEEP_ALIVE_S), limit_concurrency=MAX_HTTP_CONNECTIONS, backlog=512)
    server = uvicorn.Server(config)
    return server, HttpListener(server, port)
