"""Plain-socket transport, for hosts without RDMA and for tests.

The receiver listens on a data port. A sender opens one data connection per
write and sends frames `header + payload`; the receiver checks each header's
generation against the one it is armed for and `recv_into`s the payload straight
into the registered receive buffer (no intermediate copy). A frame of another
generation, or one outside the armed range, closes the connection: late and
foreign writers are dropped. An end frame makes the receiver answer with the
byte count it stored, so `wait()` on the sender means "landed", not "sent".

The data listener survives accept errors (tilepd.transport.listener) and serves at most `MAX_DATA_CONNECTIONS`
at once; a data connection that sends nothing for `IDLE_TIMEOUT_S` is closed.

Disarming (transfer finished, cancelled or timed out) shuts down every open data
connection and waits for its thread to leave `recv_into`, so no stale payload can
land after the next generation is armed.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from typing import Any, Sequence

from tilepd.transport.base import (
    Buffer,
    Peer,
    Segment,
    ThreadHandle,
    TransportError,
    TransportReceiver,
    TransportSender,
    WriteHandle,
)
from tilepd.transport.listener import Addr, Listener

log = logging.getLogger("tilepd.transport.tcp")

_HDR = struct.Struct(">4sQQQ")  # magic, generation, dst offset, length
_MAGIC_DATA = b"TPD1"
_MAGIC_END = b"TPDE"
_ACK = struct.Struct(">Q")
CHUNK = 16 << 20  # payload is moved in chunks so aborts and disarms take effect quickly
_SOCK_BUF = 8 << 20
IDLE_TIMEOUT_S = 30.0  # a data connection silent this long (no header, no payload byte) is dropped
MAX_DATA_CONNECTIONS = 64  # one per sender rank and write in flight


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


class TcpPeer(Peer):
    def __init__(self, host: str, port: int, nbytes: int):
        self.host, self.port, self.nbytes = host, port, nbytes

    def __repr__(self) -> str:
        return f"TcpPeer({self.host}:{self.port})"


class TcpSender(TransportSender):
    name = "tcp"

    def __init__(self, connect_timeout_s: float = 5.0, io_timeout_s: float = 60.0):
        self._buf: Buffer | None = None
        self._connect_timeout = connect_timeout_s
        self._io_timeout = io_timeout_s

    def register(self, buf: Buffer) -> None:
        if buf.device != "cpu":
            raise TransportError("tcp sends from host memory; stage the KV in a CPU buffer (or use nixl/mooncake for VRAM)")
        self._buf = buf

    def connect(self, peer_metadata: dict[str, Any]) -> TcpPeer:
        try:
            return TcpPeer(str(peer_metadata["host"]), int(peer_metadata["port"]), int(peer_metadata["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"tcp peer metadata needs host, port and nbytes; got {peer_metadata!r}") from exc

    def write(self, peer: Peer, segments: Sequence[Segment], *, generation: int, transfer_id: str) -> WriteHandle:
        assert isinstance(peer, TcpPeer)
        buf, segs = self.staged_segments(self._buf, peer, segments)

        def run(abort: threading.Event) -> int:
            try:
                return write_all(abort)
            except OSError as exc:
                raise TransportError(
                    f"transfer {transfer_id}: data connection to {peer.host}:{peer.port} failed ({exc}); the receiver "
                    f"drops writers whose generation ({generation}) is no longer current"
                ) from exc

        def write_all(abort: threading.Event) -> int:
            with socket.create_connection((peer.host, peer.port), timeout=self._connect_timeout) as sock:
                _tune(sock)
                sock.settimeout(self._io_timeout)
                total = 0
                for s in segs:
                    sock.sendall(_HDR.pack(_MAGIC_DATA, generation, s.dst, s.length))
                    off = 0
                    while off < s.length:
                        if abort.is_set():
                            raise TransportError(f"transfer {transfer_id}: write aborted")
                        n = min(CHUNK, s.length - off)
                        sock.sendall(buf.memoryview(s.src + off, n))
                        off += n
                    total += s.length
                sock.sendall(_HDR.pack(_MAGIC_END, generation, 0, total))
                ack = _recv_exact(sock, _ACK.size)
                if ack is None:
                    raise TransportError(
                        f"transfer {transfer_id}: the receiver closed the data connection (generation {generation} no longer current)"
                    )
                (stored,) = _ACK.unpack(ack)
                if stored != total:
                    raise TransportError(f"transfer {transfer_id}: receiver stored {stored} of {total} bytes")
                return total

        return ThreadHandle(run, name=f"tcp-write-{transfer_id}")


class _Conn:
    def __init__(self, sock: socket.socket, addr: tuple[str, int]):
        self.sock, self.addr = sock, addr
        self.thread: threading.Thread | None = None


class TcpReceiver(TransportReceiver):
    """Listens on `bind_host:port` (0 = any free port) and stores frames of the armed generation."""

    name = "tcp"

    def __init__(self, bind_host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 allowed_senders: Sequence[str] = ()):
        self._buf: Buffer | None = None
        self._lock = threading.Condition()
        self._generation: int | None = None
        self._transfer_id = ""
        self._limit = 0
        self._received: dict[int, int] = {}
        self._total = 0
        self._conns: set[_Conn] = set()
        self._allowed = set(allowed_senders)
        self.listener = Listener("data", socket.create_server((bind_host, port), backlog=64, reuse_port=False), self._on_accept,
                                 active=lambda: len(self._conns), max_connections=MAX_DATA_CONNECTIONS)
        self.port: int = self.listener.port
        self.advertise_host = advertise_host or (bind_host if bind_host not in ("0.0.0.0", "::", "") else "127.0.0.1")
        self._closed = False
        self.listener.start()

    # -- TransportReceiver -------------------------------------------------------------
    def register(self, buf: Buffer) -> None:
        if buf.device != "cpu":
            raise TransportError("tcp receives into host memory; set recv_buffer: dram for the tcp transport")
        self._buf = buf

    def describe(self) -> dict[str, Any]:
        if self._buf is None:
            raise TransportError("no receive buffer registered")
        return {"host": self.advertise_host, "port": self.port, "nbytes": self._buf.nbytes}

    def arm(self, generation: int, transfer_id: str, limit: int) -> None:
        if self._buf is None or limit > self._buf.nbytes:
            raise TransportError(f"cannot arm {limit} bytes: receive buffer holds {self._buf.nbytes if self._buf else 0}")
        self.disarm()
        with self._lock:
            self._generation, self._transfer_id, self._limit = generation, transfer_id, limit
            self._received[generation] = 0

    def disarm(self) -> None:
        with self._lock:
            self._generation = None
            self._limit = 0
            conns = list(self._conns)
            self._received = {}
        for c in conns:  # stop stale writers mid-payload; their threads then exit
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for c in conns:
            if c.thread is not None and c.thread is not threading.current_thread():
                c.thread.join(timeout=5.0)

    def wait_received(self, generation: int, nbytes: int, timeout: float, key: str = "") -> bool:
        with self._lock:
            return self._lock.wait_for(
                lambda: self._received.get(generation, -1) >= nbytes or self._generation != generation, timeout
            ) and self._received.get(generation, -1) >= nbytes

    def bytes_received(self) -> int:
        return self._total

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.disarm()

    def listener_problem(self) -> str | None:
        return self.listener.problem()

    # -- internals ---------------------------------------------------------------------
    def _on_accept(self, sock: socket.socket, addr: Addr) -> None:
        if self._allowed and addr[0] not in self._allowed:
            log.warning("event=data_refused peer=%s reason=not_in_allowed_senders", addr[0])
            sock.close()
            return
        _tune(sock)
        sock.settimeout(IDLE_TIMEOUT_S)
        conn = _Conn(sock, addr)
        conn.thread = threading.Thread(target=self._serve, args=(conn,), name=f"tcp-recv-{addr[0]}:{addr[1]}", daemon=True)
        with self._lock:  # started under the lock: disarm() only ever joins started threads
            self._conns.add(conn)
            try:
                conn.thread.start()
            except BaseException:
                self._conns.discard(conn)
                raise

    def _serve(self, conn: _Conn) -> None:
        sock = conn.sock
        stored = 0
        try:
            while True:
                raw = _recv_exact(sock, _HDR.size)
                if raw is None:
                    return
                magic, gen, dst, length = _HDR.unpack(raw)
                with self._lock:
                    current, limit, tid = self._generation, self._limit, self._transfer_id
                if magic == _MAGIC_END:
                    if gen != current:
                        log.info("event=data_dropped peer=%s generation=%d current=%s reason=stale_end", conn.addr[0], gen, current)
                        return
                    sock.sendall(_ACK.pack(stored))
                    stored = 0
                    continue
                if magic != _MAGIC_DATA:
                    log.warning("event=data_dropped peer=%s reason=bad_magic", conn.addr[0])
                    return
                if gen != current:
                    log.info("event=data_dropped peer=%s generation=%d current=%s reason=stale_or_foreign", conn.addr[0], gen, current)
                    return
                if dst + length > limit:
                    log.warning("event=data_dropped transfer_id=%s peer=%s reason=out_of_range dst=%d len=%d limit=%d",
                                tid, conn.addr[0], dst, length, limit)
                    return
                assert self._buf is not None
                off = 0
                while off < length:
                    with self._lock:
                        if self._generation != gen:
                            return
                    n = min(CHUNK, length - off)
                    view = self._buf.memoryview(dst + off, n)
                    got = 0
                    while got < n:
                        k = sock.recv_into(view[got:], n - got)
                        if k == 0:
                            return
                        got += k
                    off += n
                    with self._lock:
                        if self._generation == gen:
                            self._received[gen] = self._received.get(gen, 0) + n
                            self._total += n
                            self._lock.notify_all()
                stored += length
        except OSError:
            return
        finally:
            try:
                sock.close()
            except OSError:
                pass
            with self._lock:
                self._conns.discard(conn)
