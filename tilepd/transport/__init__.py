"""tilepd.transport: move KV bytes from a prefill host's staging buffer into a decode node's receive buffer.

`make_sender` / `make_receiver` build an implementation (`tcp`, `nixl`, `mooncake`)
from a `TransportConfig`; `Buffer` wraps the memory to register; `Segment` is one
(src, dst, length) copy. `tilepd.transport.bench.raw_bandwidth` measures a
transport between two processes.
"""

from tilepd.transport.base import (
    Buffer,
    Segment,
    TransportError,
    TransportReceiver,
    TransportSender,
    TransportUnavailable,
    WriteHandle,
    coalesce,
)
from tilepd.transport.registry import make_receiver, make_sender

__all__ = [
    "Buffer",
    "Segment",
    "TransportError",
    "TransportReceiver",
    "TransportSender",
    "TransportUnavailable",
    "WriteHandle",
    "coalesce",
    "make_receiver",
    "make_sender",
]
