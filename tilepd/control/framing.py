"""Length-prefixed JSON frames for the control channel.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON
holding one object. The cap keeps a confused or hostile peer from making the
decode node allocate without bound; any bad frame raises `FrameError`, and the
caller closes the connection (it never reaches the slot).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

MAX_FRAME_BYTES = 1 << 20  # 1 MiB, INTERFACES §3
_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent something that is not a valid frame; close the connection."""


class PeerClosed(FrameError):
    """The peer closed the connection (cleanly or mid-frame)."""


def encode_frame(obj: dict[str, Any]) -> bytes:
    """Serialise one message; refuses objects over the cap so a sender fails early."""
    body = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte cap")
    return _HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(encode_frame(obj))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerClosed(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame; raises `FrameError` on oversize, bad UTF-8/JSON or a non-object."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > max_bytes:
        raise FrameError(f"frame length {length} exceeds the {max_bytes}-byte cap")
    if length == 0:
        raise FrameError("empty frame")
    body = _recv_exact(sock, length)
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"frame is not UTF-8 JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise FrameError(f"frame holds a JSON {type(obj).__name__}, expected an object")
    return obj
