"""A TCP relay in front of a decode node's HTTP port that can hold the node's answers to `/v1/decode` (or in front of
any HTTP server, holding the answers to another request line: a prefill's `/v1/completions`).

A fault injector, not a stand-in: every byte goes to and from the real node. What the real parts cannot do on demand
is keep a router's lease on a node for as long as a test needs: a decode ends when its tokens are out, and a client
that stops reading is no hold either (the kernel's socket buffers take a whole 1000-token stream on loopback). Held
here, the router waits for its first token with the node alive (its /health probes pass through, unheld), so its
liveness watch does not trip; the first-token deadline (KV_WAIT_S + steps, lowlatency.py) is far above any hold a
test asks for.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tilepd.connector.launch import free_port

_CHUNK = 65536


class HeldRelay:
    """Listens on 127.0.0.1:`port` and forwards each connection to `target_port`; `holding()` holds the answers to the
    requests whose first line starts with `held` (default: decodes)."""

    def __init__(self, target_port: int, held: bytes = b"POST /v1/decode ") -> None:
        self.target_port = target_port
        self.held = held
        self.port = free_port()
        self._released = threading.Event()
        self._released.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.held_decodes = 0  # answers that were held (a test checks that its hold took)
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Inside the block, the node's answer to any `/v1/decode` waits in the relay; leaving it lets it through."""
        self._released.clear()
        try:
            yield
        finally:
            self._released.set()

    def close(self) -> None:
        self._closed.set()
        self._released.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, upstream]
            conn = _Connection()
            threading.Thread(target=self._requests, args=(client, upstream, conn), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client, conn), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket, conn: _Connection) -> None:
        """Router to node; notes whether the request on this connection is a decode (HTTP/1.1: one at a time)."""
        while data := _recv(src):
            if data.startswith((b"GET ", b"POST ", b"PUT ", b"DELETE ")):
                conn.decode = data.startswith(self.held)
            if not _send(dst, data):
                break
        _shut(dst)

    def _answers(self, src: socket.socket, dst: socket.socket, conn: _Connection) -> None:
        """Node to router; a decode's answer waits while a hold is on."""
        while data := _recv(src):
            if conn.decode and not self._released.is_set():
                self.held_decodes += 1
                self._released.wait()
            if not _send(dst, data):
                break
        _shut(dst)


class _Connection:
    decode = False


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(_CHUNK)
    except OSError:
        return b""


def _send(s: socket.socket, data: bytes) -> bool:
    try:
        s.sendall(data)
        return True
    except OSError:
        return False


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
