"""Mooncake transfer-engine transport (RDMA, or its own TCP protocol), peer-to-peer handshake.

`mooncake-transfer-engine` is imported only when this transport is chosen: its
wheel links against the NVIDIA driver (`libcuda.so.1`), so on a host without one
the import fails and we say so instead of crashing at startup. No metadata server
is needed: each engine starts with `P2PHANDSHAKE` and the receiver's session name
(`host:rpc_port`) and buffer address travel in hello_ok.

Writes are one-sided and synchronous (`batch_transfer_sync_write`): when `wait()`
returns the bytes have landed, so the receiver trusts the sender's `done` for
the armed generation; like nixl, a stale writer is stopped by the control channel.
"""

from __future__ import annotations

import socket
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
    TransportUnavailable,
    WriteHandle,
)


def load_engine_class() -> Any:
    """mooncake's TransferEngine class, or TransportUnavailable saying why it cannot load here."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportUnavailable(
            f"the mooncake transport cannot load here ({exc}): it needs the mooncake-transfer-engine package "
            "(pip install 'tilepd[mooncake]') and, for that wheel, an NVIDIA driver (libcuda.so.1); "
            "use transport 'nixl' or 'tcp' on hosts without them"
        ) from exc
    except OSError as exc:  # a shared library it links against is missing
        raise TransportUnavailable(
            f"the mooncake transport cannot load here ({exc}): its wheel needs an NVIDIA driver (libcuda.so.1); "
            "use transport 'nixl' or 'tcp' on hosts without one"
        ) from exc
    return TransferEngine


def _local_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _start(host: str, protocol: str, devices: str | None) -> Any:
    engine = load_engine_class()()
    ret = engine.initialize(host, "P2PHANDSHAKE", protocol, devices or "")
    if ret != 0:
        raise TransportError(f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {devices!r}) returned {ret}")
    return engine


def _register(engine: Any, buf: Buffer) -> None:
    ret = engine.register_memory(buf.ptr, buf.nbytes)
    if ret != 0:
        raise TransportError(f"mooncake register_memory of {buf.nbytes} bytes on {buf.device} returned {ret}")


class MooncakePeer(Peer):
    def __init__(self, session: str, addr: int, nbytes: int):
        self.session, self.addr, self.nbytes = session, addr, nbytes


class MooncakeSender(TransportSender):
    name = "mooncake"

    def __init__(self, protocol: str = "rdma", devices: str | None = None, local_host: str | None = None):
        self.engine = _start(local_host or _local_host(), protocol, devices)
        self._buf: Buffer | None = None
        self._lock = threading.Lock()

    def register(self, buf: Buffer) -> None:
        _register(self.engine, buf)
        self._buf = buf

    def connect(self, peer_metadata: dict[str, Any]) -> MooncakePeer:
        try:
            return MooncakePeer(str(peer_metadata["session"]), int(peer_metadata["addr"]), int(peer_metadata["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"mooncake peer metadata needs session, addr and nbytes; got {peer_metadata!r}") from exc

    def write(self, peer: Peer, segments: Sequence[Segment], *, generation: int, transfer_id: str) -> WriteHandle:
        assert isinstance(peer, MooncakePeer)
        buf, segs = self.staged_segments(self._buf, peer, segments)
        srcs = [buf.ptr + s.src for s in segs]
        dsts = [peer.addr + s.dst for s in segs]
        lens = [s.length for s in segs]

        def run(abort: threading.Event) -> int:
            with self._lock:
                if hasattr(self.engine, "batch_transfer_sync_write"):
                    ret = self.engine.batch_transfer_sync_write(peer.session, srcs, dsts, lens)
                else:
                    ret = 0
                    for s, d, n in zip(srcs, dsts, lens):
                        ret = ret or self.engine.transfer_sync_write(peer.session, s, d, n)
            if ret != 0:
                raise TransportError(f"transfer {transfer_id}: mooncake write to {peer.session} returned {ret}")
            return sum(lens)

        return ThreadHandle(run, name=f"mooncake-write-{transfer_id}")

    def close(self) -> None:
        if self._buf is not None:
            try:
                self.engine.unregister_memory(self._buf.ptr)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._buf = None


class MooncakeReceiver(TransportReceiver):
    name = "mooncake"

    def __init__(self, advertise_host: str = "127.0.0.1", protocol: str = "rdma", devices: str | None = None):
        self.engine = _start(advertise_host, protocol, devices)
        self.session = f"{advertise_host}:{self.engine.get_rpc_port()}"
        self._buf: Buffer | None = None
        self._cv = threading.Condition()
        self._generation: int | None = None
        self._total = 0

    def register(self, buf: Buffer) -> None:
        _register(self.engine, buf)
        self._buf = buf

    def describe(self) -> dict[str, Any]:
        if self._buf is None:
            raise TransportError("no receive buffer registered")
        return {"session": self.session, "addr": self._buf.ptr, "nbytes": self._buf.nbytes}

    def arm(self, generation: int, transfer_id: str, limit: int) -> None:
        with self._cv:
            self._generation = generation

    def disarm(self) -> None:
        with self._cv:
            self._generation = None

    def wait_received(self, generation: int, nbytes: int, timeout: float, key: str = "") -> bool:
        with self._cv:
            if self._generation != generation:
                return False
            self._total += nbytes
            return True

    def bytes_received(self) -> int:
        return self._total

    def close(self) -> None:
        if self._buf is not None:
            try:
                self.engine.unregister_memory(self._buf.ptr)
            except Exception:  # noqa: BLE001
                pass
            self._buf = None
