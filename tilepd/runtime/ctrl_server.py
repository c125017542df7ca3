"""Control-channel server of the decode node (INTERFACES §3).

One thread per sender connection, at most `MAX_CONNECTIONS` of them (the listener answers a connection past the
cap with a typed error and closes it). A connection must say `hello` first, within `HELLO_TIMEOUT_S` of its
accept; the hello fixes its layout, which sizes its regions in the receive buffer. After that a frame's first byte
may take `IDLE_TIMEOUT_S` (a quiet sender keeps its cached hello) and the rest of it `FRAME_TIMEOUT_S`, so a peer
that sends half a frame and stalls holds its thread for seconds, not an hour. A frame that does not parse closes
the connection and never reaches the slot; a refusal (mismatch, busy, bad token) is answered with a typed message
and the connection stays open.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Callable, Sequence

import torch

from tilepd.contracts.fingerprint import Fingerprint
from tilepd.control.checksum import first_mismatch, region_digests
from tilepd.control.compat import check_fingerprint, check_hello, check_raw_hello
from tilepd.control.framing import FrameError, PeerClosed, recv_frame, send_frame
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.messages import (
    PROTOCOL_VERSION,
    RETRYABLE,
    Accept,
    Ack,
    Admit,
    Done,
    Dst,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    ProtocolError,
    Region,
    Reject,
    SegmentDst,
    TransportInfo,
    dump,
    parse_message,
)
from tilepd.runbooks import cite
from tilepd.runtime.slot import Slot, SlotError
from tilepd.transport.base import TransportReceiver
from tilepd.transport.listener import Addr, Listener

log = logging.getLogger("tilepd.runtime.ctrl")

IDLE_TIMEOUT_S = 600.0  # a quiet sender keeps its connection (hello is cached) this long; the sender reconnects after
HELLO_TIMEOUT_S = 10.0  # from accept to a whole hello frame
FRAME_TIMEOUT_S = 10.0  # from a frame's first byte to its last
MAX_CONNECTIONS = 256  # control connections served at once (prefill ranks x instances need a few dozen)
DATA_DRAIN_TIMEOUT_S = 30.0  # after done: how long bytes the sender reported may take to land
# refusals of a hello that mean the two ends disagree, and the runbook of each
_RUNBOOK_OF = {ErrorCode.VERSION_MISMATCH: "RB-protocol-mismatch", ErrorCode.LAYOUT_MISMATCH: "RB-protocol-mismatch",
               ErrorCode.TRANSPORT_MISMATCH: "RB-protocol-mismatch", ErrorCode.FINGERPRINT_MISMATCH: "RB-fingerprint-mismatch"}


class _Deadline:
    """The socket as `recv_frame` reads it, with one deadline over every recv of a frame (a socket timeout alone
    restarts at each byte: a peer dripping a byte at a time would hold the connection without bound)."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def recv_into(self, view: memoryview, n: int) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("frame not complete in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(view, n)


def _read_frame(sock: socket.socket, first_byte_s: float, frame_s: float, deadline: float | None = None) -> dict:
    """One frame: its first byte within `first_byte_s`, the whole of it `frame_s` after that (or by `deadline`)."""
    sock.settimeout(first_byte_s)
    if not sock.recv(1, socket.MSG_PEEK):
        raise PeerClosed("peer closed the connection")
    frame = recv_frame(_Deadline(sock, deadline if deadline is not None else time.monotonic() + frame_s))
    sock.settimeout(frame_s)  # for the reply: the deadline's remainder may be a few milliseconds
    return frame


def _refusal(exc: ProtocolError) -> tuple[str, str]:
    """(message, log field) of a refused hello: a prefill/decode mismatch names its runbook in both."""
    book = _RUNBOOK_OF.get(exc.code)
    if book is not None:
        return cite(exc.message, book), f" runbook={book}"
    return exc.message, ""


class ControlServer:
    def __init__(
        self,
        *,
        slot: Slot,
        receiver: TransportReceiver,
        max_seq_len: int,
        check_layout: Callable[[CacheLayout, int], None],
        node_name: str = "",
        bind_host: str = "127.0.0.1",
        port: int = 0,
        allowed_senders: Sequence[str] = (),
        recv_bytes: torch.Tensor | None = None,
        fingerprint: Fingerprint | None = None,
    ):
        self.slot, self.receiver = slot, receiver
        self.max_seq_len = max_seq_len
        self.check_layout = check_layout
        self.node_name = node_name
        self.fingerprint = fingerprint  # what this node's weights were converted from; every hello must match it
        self.allowed = set(allowed_senders)
        # the receive buffer as flat uint8: each rank's checksums are verified over it at its `done`
        self.recv_bytes = recv_bytes
        self.checksum_failures = 0
        self.last_verify_ms = 0.0  # what verifying the last transfer's checksums took (bench/checksum_cost.py)
        self.listener = Listener("control", socket.create_server((bind_host, port), backlog=64), self._on_accept,
                                 active=lambda: len(self._socks), max_connections=MAX_CONNECTIONS, on_full=self._refuse_full)
        self.port: int = self.listener.port
        self._ids = itertools.count(1)
        self._closed = False
        self._socks: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self.frames_rejected = 0
        # (transfer_id, token) -> bool; set by the server when the deployment has a secret (tilepd.auth)
        self.token_ok: Callable[[str, str], bool] | None = None

    def start(self) -> "ControlServer":
        self.listener.start()
        log.info("event=ctrl_listening port=%d", self.port)
        return self

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            socks = list(self._socks.values())
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def revoke(self, conn_id: int) -> None:
        """Close the control connection of a transfer the slot took away; its sender aborts the write."""
        with self._lock:
            sock = self._socks.get(conn_id)
        if sock is not None:
            log.info("event=revoked conn=%d", conn_id)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- connection handling ---------------------------------------------------------
    def _on_accept(self, sock: socket.socket, addr: Addr) -> None:
        if self.allowed and addr[0] not in self.allowed:
            log.warning("event=ctrl_refused peer=%s reason=not_in_allowed_senders", addr[0])
            try:
                sock.settimeout(1.0)
                send_frame(sock, dump(Error(code=ErrorCode.NOT_ALLOWED, message=f"{addr[0]} is not in this decode node's allowed_senders")))
            except OSError:
                pass
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn_id = next(self._ids)
        with self._lock:
            self._socks[conn_id] = sock
        try:
            threading.Thread(target=self._serve, args=(sock, addr, conn_id), name=f"ctrl-{conn_id}", daemon=True).start()
        except BaseException:
            with self._lock:
                self._socks.pop(conn_id, None)
            raise

    @staticmethod
    def _refuse_full(sock: socket.socket, addr: Addr) -> None:
        sock.settimeout(1.0)
        send_frame(sock, dump(Error(code=ErrorCode.BUSY, message=f"this decode node serves {MAX_CONNECTIONS} control connections "
                                                                "already; retry later")))

    def _serve(self, sock: socket.socket, addr: tuple[str, int], conn_id: int) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        hello: Hello | None = None
        hello_by = time.monotonic() + HELLO_TIMEOUT_S
        try:
            while True:
                try:
                    if hello is None:
                        raw = _read_frame(sock, max(hello_by - time.monotonic(), 0.001), FRAME_TIMEOUT_S, deadline=hello_by)
                    else:
                        raw = _read_frame(sock, IDLE_TIMEOUT_S, FRAME_TIMEOUT_S)
                except PeerClosed:
                    return
                except FrameError as exc:
                    self.frames_rejected += 1
                    log.warning("event=bad_frame peer=%s conn=%d reason=%s", peer, conn_id, exc)
                    return
                try:
                    check_raw_hello(raw)  # another protocol version: answer with what to upgrade, then close
                except ProtocolError as exc:
                    message, book = _refusal(exc)
                    log.warning("event=hello_refused peer=%s conn=%d code=%s%s message=%s", peer, conn_id, exc.code.value, book, message)
                    send_frame(sock, dump(Error(code=exc.code, message=message)))
                    return
                try:
                    msg = parse_message(raw)
                except ProtocolError as exc:
                    self.frames_rejected += 1
                    log.warning("event=bad_frame peer=%s conn=%d reason=%s", peer, conn_id, exc)
                    return
                if isinstance(msg, Hello):
                    reply, hello = self._hello(msg, peer, conn_id)
                    send_frame(sock, reply)
                    if reply["type"] == "error":
                        return
                elif isinstance(msg, Admit):
                    if hello is None:
                        send_frame(sock, dump(Error(code=ErrorCode.NOT_READY, message="send hello before admit")))
                        return
                    send_frame(sock, self._admit(msg, hello, peer, conn_id))
                elif isinstance(msg, Done):
                    if hello is None:
                        send_frame(sock, dump(Error(code=ErrorCode.NOT_READY, message="send hello before done")))
                        return
                    send_frame(sock, self._done(msg, hello, peer, conn_id))
                else:
                    self.frames_rejected += 1
                    log.warning("event=bad_frame peer=%s conn=%d reason=unexpected_%s", peer, conn_id, msg.type)
                    return
        except OSError as exc:
            # a reset, not a clean close or a timeout: the prefill (connector) died or restarted
            book = "" if isinstance(exc, TimeoutError) else " runbook=RB-prefill-restarted"
            why = ("no_hello" if hello is None else "idle_or_slow_frame") if isinstance(exc, TimeoutError) else "reset"
            log.info("event=ctrl_closed peer=%s conn=%d why=%s%s reason=%s", peer, conn_id, why, book, exc)
        finally:
            self.slot.sender_gone(conn_id)
            with self._lock:
                self._socks.pop(conn_id, None)
            try:
                sock.close()
            except OSError:
                pass

    # -- messages ---------------------------------------------------------------------
    def _hello(self, msg: Hello, peer: str, conn_id: int) -> tuple[dict, Hello | None]:
        try:
            check_hello(msg, transport=self.receiver.name, max_seq_len=self.max_seq_len)
            if msg.sender_rank >= msg.tp_size:
                raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"sender_rank {msg.sender_rank} is not below tp_size {msg.tp_size}")
            self.check_layout(msg.layout, msg.tp_size)
            # after the layout: a layout mismatch (another architecture) says what to fix better than two checkpoint ids
            check_fingerprint(msg.fingerprint, self.fingerprint, self.node_name)
            self.receiver.add_peer(msg.transport.metadata)
        except ProtocolError as exc:
            message, book = _refusal(exc)
            log.warning("event=hello_refused peer=%s conn=%d code=%s%s message=%s", peer, conn_id, exc.code.value, book, message)
            return dump(Error(code=exc.code, message=message)), None
        lay = msg.layout
        base = msg.sender_rank * lay.buffer_bytes(self.max_seq_len)
        stride = lay.region_stride(self.max_seq_len)
        regions = [Region(layer=i, offset=base + i * stride, length=stride) for i in range(lay.num_layers)]
        if lay.indexer is not None:
            ib, istride = base + lay.indexer_base(self.max_seq_len), lay.indexer.region_stride(self.max_seq_len)
            regions += [Region(segment="indexer", layer=l, offset=ib + j * istride, length=istride) for j, l in enumerate(lay.indexer.layers)]
        log.info("event=hello peer=%s conn=%d rank=%d layout=%s transport=%s fingerprint=%s", peer, conn_id, msg.sender_rank,
                 msg.layout.layout_id, msg.transport.name, msg.fingerprint.id if msg.fingerprint is not None else "-")
        reply = HelloOk(protocol=PROTOCOL_VERSION, transport=TransportInfo(name=self.receiver.name, metadata=self.receiver.describe()),
                        regions=regions, busy=self.slot.busy, node=self.node_name, fingerprint=self.fingerprint)
        return dump(reply), msg

    def _admit(self, msg: Admit, hello: Hello, peer: str, conn_id: int) -> dict:
        layout, tp, rank = hello.layout, hello.tp_size, hello.sender_rank
        def reject(code: ErrorCode, message: str) -> dict:
            level = logging.INFO if code in RETRYABLE else logging.WARNING
            log.log(level, "event=admit_rejected transfer_id=%s peer=%s code=%s message=%s", msg.transfer_id, peer, code.value, message)
            return dump(Reject(transfer_id=msg.transfer_id, code=code, retryable=code in RETRYABLE, message=message))

        if msg.seq_len > self.max_seq_len:
            return reject(ErrorCode.TOO_LONG, f"seq_len {msg.seq_len} exceeds this decode node's max_seq_len {self.max_seq_len}")
        if msg.num_blocks != layout.blocks_for(msg.seq_len):
            return reject(ErrorCode.LAYOUT_MISMATCH, f"num_blocks {msg.num_blocks} != ceil(seq_len {msg.seq_len} / block_size {layout.block_size})")
        if msg.sender_rank != rank:
            return reject(ErrorCode.MALFORMED, f"admit says sender_rank {msg.sender_rank} but this connection's hello said {rank}")
        stride = layout.region_stride(self.max_seq_len)
        rank_bytes = layout.buffer_bytes(self.max_seq_len)
        # rank r's regions follow those of ranks 0..r-1; the receiver is armed up to the last region used
        expected = tp * layout.transfer_bytes(msg.seq_len)
        limit = (tp - 1) * rank_bytes + max(off + n for _, _, off, n in layout.regions(self.max_seq_len, msg.seq_len))
        if self.token_ok is not None and not self.token_ok(msg.transfer_id, msg.token):
            return reject(ErrorCode.BAD_TOKEN, f"token of transfer {msg.transfer_id} was not minted with this deployment's secret")
        try:
            gen = self.slot.admit(msg.transfer_id, msg.token, msg.seq_len, msg.num_blocks, expected, layout, conn_id,
                                  arm_limit=limit, sender_rank=rank, tp_size=tp)
        except SlotError as exc:
            return reject(ErrorCode(exc.code), exc.message)
        base = rank * rank_bytes
        ix = None
        if layout.indexer is not None:
            ix = SegmentDst(base=base + layout.indexer_base(self.max_seq_len), region_stride=layout.indexer.region_stride(self.max_seq_len),
                            block_bytes=layout.indexer.block_bytes)
        return dump(Accept(transfer_id=msg.transfer_id, generation=gen,
                           dst=Dst(base=base, region_stride=stride, block_bytes=layout.block_bytes, indexer=ix)))

    def _done(self, msg: Done, hello: Hello, peer: str, conn_id: int) -> dict:
        cur = self.slot.current
        rank = hello.sender_rank
        if msg.ok and cur is not None and cur.generation == msg.generation and cur.transfer_id == msg.transfer_id \
                and cur.conn_ids.get(rank) == conn_id:
            want = cur.expected_bytes // max(cur.tp_size, 1)
            if msg.bytes != want:
                ok, why = self.slot.complete(msg.transfer_id, msg.generation, False,
                                             f"rank {rank} reported {msg.bytes} bytes, expected {want}", sender_rank=rank,
                                             conn_id=conn_id)
                return dump(Ack(transfer_id=msg.transfer_id, ok=False, message=why))
            if not self.receiver.wait_received(msg.generation, want, DATA_DRAIN_TIMEOUT_S, key=f"{msg.transfer_id}/{rank}"):
                ok, why = self.slot.complete(msg.transfer_id, msg.generation, False,
                                             f"rank {rank}'s {want} bytes did not land", sender_rank=rank, conn_id=conn_id)
                return dump(Ack(transfer_id=msg.transfer_id, ok=False, message=why))
            t_verify = time.perf_counter()
            bad = self._verify(msg, hello, cur.seq_len)
            self.last_verify_ms = (time.perf_counter() - t_verify) * 1e3
            if bad is not None:
                self.checksum_failures += 1
                log.error("event=kv_checksum_mismatch transfer_id=%s peer=%s generation=%d rank=%d %s", msg.transfer_id, peer,
                          msg.generation, rank, bad)
                self.slot.complete(msg.transfer_id, msg.generation, False, bad, sender_rank=rank, conn_id=conn_id,
                                   code=ErrorCode.KV_CHECKSUM_MISMATCH.value)
                return dump(Ack(transfer_id=msg.transfer_id, ok=False, message=bad))
        ok, why = self.slot.complete(msg.transfer_id, msg.generation, msg.ok, msg.error, sender_rank=rank, conn_id=conn_id)
        log.info("event=done transfer_id=%s peer=%s generation=%d ok=%s accepted=%s verify_ms=%.2f", msg.transfer_id, peer,
                 msg.generation, msg.ok, ok, self.last_verify_ms)
        return dump(Ack(transfer_id=msg.transfer_id, ok=ok, message=why))

    def _verify(self, msg: Done, hello: Hello, seq_len: int) -> str | None:
        """None when every region that landed hashes to the sender's digest; else the typed failure message."""
        if self.recv_bytes is None:
            return None
        lay = hello.layout
        base = hello.sender_rank * lay.buffer_bytes(self.max_seq_len)
        regions = lay.regions(self.max_seq_len, seq_len)
        if len(msg.checksums) != len(regions):
            return (f"{ErrorCode.KV_CHECKSUM_MISMATCH.value}: rank {hello.sender_rank} sent {len(msg.checksums)} checksums for "
                    f"{len(regions)} regions; nothing is decoded from unverified bytes")
        got = region_digests(self.recv_bytes, [(base + off, n) for _, _, off, n in regions])
        i = first_mismatch(msg.checksums, got)
        if i is None:
            return None
        seg, layer, _, n = regions[i]
        return (f"{ErrorCode.KV_CHECKSUM_MISMATCH.value}: rank {hello.sender_rank}'s {seg} region of layer {layer} ({n} bytes) "
                f"hashes to {got[i]} on the decode node, the sender staged {msg.checksums[i]} ({ErrorCode.KV_CHECKSUM_MISMATCH.value}); "
                "the request fails instead of decoding from a damaged cache")
