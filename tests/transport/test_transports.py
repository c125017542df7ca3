"""Transports move bytes correctly between two real processes; tcp drops writers of another generation."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from tilepd.transport import Buffer, Segment, TransportError, coalesce
from tilepd.transport.bench import ReceiverProcess, raw_bandwidth
from tilepd.transport.tcp import TcpReceiver, TcpSender


def test_coalesce_merges_contiguous_segments() -> None:
    segs = coalesce([(0, 100, 10), (10, 110, 10), (30, 200, 5), (20, 120, 0)])
    assert segs == [Segment(0, 100, 20), Segment(30, 200, 5)]


@pytest.mark.slow
def test_raw_bandwidth_between_two_processes_checks_bytes() -> None:
    """The bench entry point bench/handoff.py calls (nixl's two-process path is covered by the next test)."""
    r = raw_bandwidth("tcp", 32 << 20, repeats=2, warmup=1)
    assert r["checksum_ok"], r
    assert r["best_gbps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tcp", "nixl"])
def test_scattered_segments_land_where_asked(name: str) -> None:
    """Many small segments (one per block) land at their destinations in another process."""
    from tilepd.contracts.service_configs import TransportConfig
    from tilepd.transport.registry import make_sender

    import hashlib

    nbytes = 1 << 20
    rx = ReceiverProcess(name, nbytes)
    sender = make_sender(TransportConfig(name=name))
    try:
        src = np.random.default_rng(1).integers(0, 256, size=nbytes, dtype=np.uint8)
        sender.register(Buffer.from_array(src))
        peer = sender.connect(rx.metadata)
        rx.arm(7)
        block = 4096
        # reverse the block order on the way: block i -> slot (n-1-i)
        n = nbytes // block
        segs = [Segment(i * block, (n - 1 - i) * block, block) for i in range(n)]
        assert sender.write(peer, segs, generation=7, transfer_id="bench").wait(60) == nbytes
        expect = src.reshape(n, block)[::-1].tobytes()
        got = rx.check(7, nbytes)
        assert got["landed"] and got["sha256"] == hashlib.sha256(expect).hexdigest()
    finally:
        sender.close()
        rx.close()


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(8) == b""
    except ConnectionResetError:  # closed with our payload unread: RST
        return True


def _frame(magic: bytes, gen: int, dst: int, length: int) -> bytes:
    return struct.pack(">4sQQQ", magic, gen, dst, length)


def test_tcp_receiver_drops_foreign_and_late_generations() -> None:
    buf = np.zeros(4096, np.uint8)
    rx = TcpReceiver("127.0.0.1", 0)
    rx.register(Buffer.from_array(buf))
    try:
        rx.arm(5, "tx", 4096)
        # foreign writer: wrong generation -> connection closed, nothing stored
        with socket.create_connection(("127.0.0.1", rx.port)) as s:
            s.sendall(_frame(b"TPD1", 4, 0, 16) + b"\xff" * 16)
            assert _closed_by_peer(s)
        assert not buf.any() and not rx.wait_received(5, 16, 0.2)
        # out-of-range destination -> dropped
        with socket.create_connection(("127.0.0.1", rx.port)) as s:
            s.sendall(_frame(b"TPD1", 5, 4090, 16) + b"\xff" * 16)
            assert _closed_by_peer(s)
        assert not buf.any()
        # the real writer of generation 5 lands
        src = np.arange(64, dtype=np.uint8)
        snd = TcpSender()
        snd.register(Buffer.from_array(src))
        peer = snd.connect(rx.describe())
        assert snd.write(peer, [Segment(0, 100, 64)], generation=5, transfer_id="tx").wait(10) == 64
        assert (buf[100:164] == src).all() and rx.wait_received(5, 64, 1)
        # late writer: its generation was current, then the slot moved on
        rx.arm(6, "tx2", 4096)
        with pytest.raises(TransportError, match="generation"):
            snd.write(peer, [Segment(0, 0, 64)], generation=5, transfer_id="tx").wait(10)
        assert not buf[:64].any()
    finally:
        rx.close()


def test_tcp_disarm_cuts_a_writer_mid_payload() -> None:
    """A writer that stalls mid-frame is cut off when the slot is disarmed; its tail never lands."""
    buf = np.zeros(1 << 16, np.uint8)
    rx = TcpReceiver("127.0.0.1", 0)
    rx.register(Buffer.from_array(buf))
    try:
        rx.arm(9, "tx", 1 << 16)
        s = socket.create_connection(("127.0.0.1", rx.port))
        s.sendall(_frame(b"TPD1", 9, 0, 1 << 15) + b"\x01" * 1000)  # stalls after 1000 of 32768 bytes
        rx.disarm()  # returns only once the connection's thread has left recv_into
        try:
            s.sendall(b"\x02" * 2000)
        except OSError:
            pass
        s.close()
        assert not (buf == 2).any()
    finally:
        rx.close()


def test_closing_a_tcp_receiver_ends_its_accept_thread() -> None:
    """close() must wake the thread blocked in accept(): close() of the socket alone leaves it there for good."""
    import threading

    from tilepd.transport.tcp import TcpReceiver

    rx = TcpReceiver("127.0.0.1", 0)
    thread = rx.listener._thread
    assert thread.is_alive()
    rx.close()
    thread.join(2.0)
    assert not thread.is_alive() and thread not in threading.enumerate()
