"""The transport interface: register memory, describe it, write segments to a peer.

A transport moves bytes from a sender's registered buffer (the connector's staging
buffer) into a receiver's registered buffer (the decode node's receive buffer).
Control (hello/admit/done) is separate; a transport only needs the peer's
`describe()` output, exchanged through the control channel.

Every write carries the transfer *generation* the receiver granted in `accept`;
a receiver armed for generation g drops bytes of any other generation, so a late
or foreign writer cannot land in a slot that moved on (where the transport can
enforce it: tcp does per frame; one-sided RDMA transports rely on the control
channel closing the late writer's connection, see each implementation).
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

Device = Literal["cpu", "cuda"]


class TransportError(Exception):
    """A transport could not set up or complete a transfer."""


class TransportUnavailable(TransportError):
    """The transport's library cannot load on this machine (message says why)."""


@dataclass(frozen=True)
class Buffer:
    """A contiguous memory region by address and length, with its owner kept alive."""

    ptr: int
    nbytes: int
    device: Device = "cpu"
    device_id: int = 0
    owner: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_array(cls, arr: Any) -> "Buffer":
        """Wrap a contiguous numpy array or torch tensor (CPU or CUDA)."""
        mod = type(arr).__module__
        if mod.startswith("torch"):
            if not arr.is_contiguous():
                raise TransportError("tensor must be contiguous to register it")
            dev: Device = "cuda" if arr.is_cuda else "cpu"
            return cls(arr.data_ptr(), arr.numel() * arr.element_size(), dev, arr.device.index or 0, arr)
        if mod.startswith("numpy"):
            if not arr.flags["C_CONTIGUOUS"]:
                raise TransportError("array must be C-contiguous to register it")
            return cls(arr.ctypes.data, arr.nbytes, "cpu", 0, arr)
        raise TransportError(f"cannot register a {type(arr).__name__}; pass a numpy array or torch tensor")

    def memoryview(self, offset: int = 0, length: int | None = None) -> memoryview:
        """Writable bytes view of host memory (tcp reads straight into it)."""
        if self.device != "cpu":
            raise TransportError("a memoryview needs host memory; this buffer is on cuda")
        length = self.nbytes - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise TransportError(f"range [{offset}, {offset + length}) outside buffer of {self.nbytes} bytes")
        arr = (ctypes.c_char * length).from_address(self.ptr + offset)
        return memoryview(arr).cast("B")


@dataclass(frozen=True)
class Segment:
    """Copy `length` bytes from sender offset `src` to receiver offset `dst`."""

    src: int
    dst: int
    length: int


def coalesce(segments: Iterable[Segment | tuple[int, int, int]]) -> list[Segment]:
    """Merge segments contiguous on both sides, so a write becomes few large descriptors."""
    out: list[Segment] = []
    for s in sorted((s if isinstance(s, Segment) else Segment(*s) for s in segments), key=lambda s: (s.src, s.dst)):
        if s.length <= 0:
            continue
        if out and out[-1].src + out[-1].length == s.src and out[-1].dst + out[-1].length == s.dst:
            out[-1] = Segment(out[-1].src, out[-1].dst, out[-1].length + s.length)
        else:
            out.append(s)
    return out


def check_bounds(segments: Sequence[Segment], src_len: int, dst_len: int) -> None:
    for s in segments:
        if s.src < 0 or s.src + s.length > src_len:
            raise TransportError(f"segment source [{s.src}, {s.src + s.length}) outside the {src_len}-byte staging buffer")
        if s.dst < 0 or s.dst + s.length > dst_len:
            raise TransportError(f"segment destination [{s.dst}, {s.dst + s.length}) outside the peer's {dst_len}-byte buffer")


class WriteHandle(ABC):
    """An in-flight write; `wait` blocks until it completed or failed."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Return the bytes written; raise TransportError on failure or timeout."""

    def abort(self) -> None:  # noqa: B027 - optional
        """Best effort: stop a write that is still in flight."""

    def finished(self, timeout: float = 0.0) -> bool:
        """True once the write ended (well or not); waits up to `timeout` without aborting."""
        return True


class DoneHandle(WriteHandle):
    """A write that already finished (synchronous transports)."""

    def __init__(self, nbytes: int, error: Exception | None = None):
        self._n, self._err = nbytes, error

    def wait(self, timeout: float | None = None) -> int:
        if self._err:
            raise TransportError(str(self._err)) from self._err
        return self._n


class ThreadHandle(WriteHandle):
    """A write running in a helper thread."""

    def __init__(self, fn: Any, name: str):
        self._result: int | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._abort = threading.Event()

        def run() -> None:
            try:
                self._result = fn(self._abort)
            except BaseException as exc:  # noqa: BLE001 - reported through wait()
                self._error = exc
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            self.abort()
            raise TransportError(f"write did not complete within {timeout} s")
        if self._error is not None:
            if isinstance(self._error, TransportError):
                raise self._error
            raise TransportError(f"{type(self._error).__name__}: {self._error}") from self._error
        assert self._result is not None
        return self._result

    def abort(self) -> None:
        self._abort.set()

    def finished(self, timeout: float = 0.0) -> bool:
        return self._done.wait(timeout)


class Peer(ABC):
    """A sender's view of one receiver, from the receiver's `describe()`."""

    nbytes: int


class TransportSender(ABC):
    """Sender side: the connector's staging buffer and its peers."""

    name: str

    @abstractmethod
    def register(self, buf: Buffer) -> None:
        """Register the staging buffer writes read from (call once, before writes)."""

    def describe(self) -> dict[str, Any]:
        """Metadata the receiver needs about this sender (sent in hello)."""
        return {}

    @abstractmethod
    def connect(self, peer_metadata: dict[str, Any]) -> Peer:
        """Prepare to write to a receiver that described itself with `peer_metadata`."""

    @abstractmethod
    def write(self, peer: Peer, segments: Sequence[Segment], *, generation: int, transfer_id: str) -> WriteHandle:
        """Start writing; segments are coalesced and bounds-checked first."""

    def staged_segments(self, buf: "Buffer | None", peer: Peer, segments: Sequence[Segment]) -> tuple["Buffer", list[Segment]]:
        """The write preamble every sender shares: a registered buffer, coalesced and bounds-checked segments."""
        if buf is None:
            raise TransportError("register a staging buffer before writing")
        segs = coalesce(segments)
        check_bounds(segs, buf.nbytes, peer.nbytes)
        return buf, segs

    def disconnect(self, peer: Peer) -> None:  # noqa: B027 - optional
        """Drop a peer (after its control channel broke)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release everything registered."""


class TransportReceiver(ABC):
    """Receiver side: the decode node's receive buffer."""

    name: str

    @abstractmethod
    def register(self, buf: Buffer) -> None:
        """Register the receive buffer (before the first hello is answered)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """Metadata a sender needs to write here (sent in hello_ok)."""

    def add_peer(self, peer_metadata: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Learn about a sender from its hello (nixl: load its agent metadata)."""

    @abstractmethod
    def arm(self, generation: int, transfer_id: str, limit: int) -> None:
        """Accept bytes of this generation only, up to `limit` bytes from the buffer start."""

    @abstractmethod
    def disarm(self) -> None:
        """Accept no bytes (slot free, cancelled or complete)."""

    @abstractmethod
    def wait_received(self, generation: int, nbytes: int, timeout: float, key: str = "") -> bool:
        """After a sender's `done`: True once its `nbytes` of this generation have landed.

        `key` names the write (`<transfer_id>/<sender_rank>`, what the sender passed as transfer_id).
        """

    def bytes_received(self) -> int:
        return 0

    def listener_problem(self) -> str | None:
        """Why the data port takes no connection now (a receiver with its own listener says), or None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Stop listening and release registrations."""
