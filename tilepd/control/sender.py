"""Connector-side API: hand one request's KV to a decode node.

Usage (from the vLLM connector's background sender thread)::

    from tilepd.control.sender import KVSender, SendResult
    from tilepd.control.cache_layout import CacheLayout
    from tilepd.transport import Buffer

    sender = KVSender(extra_config,            # ConnectorExtraConfig (kv_connector_extra_config)
                      layout,                  # CacheLayout read from vLLM's cache tensors
                      Buffer.from_array(staging_tensor),   # registered once, writes read from it
                      sender_rank=0, tp_size=1)
    result: SendResult = sender.send(
        (host, ctrl_port),      # or a DecodeEndpoint; must be in extra_config.decode_allowlist
        transfer_id, token,     # from the tilepd marker in kv_transfer_params
        seq_len,                # tokens whose KV is sent (the prompt length)
        num_blocks,             # ceil(seq_len / layout.block_size)
        src,                    # per layer: staging offset of block 0 (blocks contiguous), or a list
                                # of num_blocks offsets (one per block) when blocks are scattered
    )
    result.ok, result.code, result.message, result.bytes, result.timings  # never raises for peer errors
    sender.close()

`send` is blocking and thread-safe (one control connection per decode endpoint,
hello done once per connection and cached). Flow: hello -> admit (busy: retry with
exponential backoff from busy_backoff_s, up to busy_retries, then give up with a
log line) -> transport write -> done/ack. A version, layout or transport mismatch
is final and its message says what to change.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np
import torch
import xxhash

from tilepd import __version__
from tilepd.control.checksum import region_digests
from tilepd.control.compat import check_hello_ok
from tilepd.control.framing import FrameError, PeerClosed, recv_frame, send_frame
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.messages import (
    MIN_TILEPD_FOR_PROTOCOL,
    PROTOCOL_VERSION,
    Accept,
    Ack,
    Admit,
    Done,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    ProtocolError,
    Reject,
    TransportInfo,
    dump,
    parse_message,
)
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint
from tilepd.transport.base import Buffer, Peer, Segment, TransportError, TransportSender, WriteHandle
from tilepd.transport.registry import make_sender

log = logging.getLogger("tilepd.control.sender")

EndpointLike = Union[DecodeEndpoint, tuple[str, int]]
SourceSpec = Union[int, Sequence[int]]

REPLY_TIMEOUT_S = 30.0
WIRE_TIMEOUT_S = 120.0
MAX_BACKOFF_S = 1.0


@dataclass
class SendResult:
    ok: bool
    transfer_id: str
    code: str | None = None  # an ErrorCode value, "transport", "connect", "not_allowed" or "revoked"
    message: str = ""
    generation: int | None = None
    bytes: int = 0
    attempts: int = 0  # admit attempts (1 + busy retries)
    timings: dict[str, float] = field(default_factory=dict)  # hello_ms, admit_ms, wire_ms, done_ms, total_ms


class _Revoked(TransportError):
    """The decode node closed the control connection mid-write: it gave the slot away."""


class _Channel:
    """One control connection to one decode node, after a successful hello."""

    def __init__(self, sock: socket.socket, hello_ok: HelloOk, peer: Peer):
        self.sock, self.hello_ok, self.peer = sock, hello_ok, peer
        self.lock = threading.Lock()

    def call(self, msg: dict, timeout: float = REPLY_TIMEOUT_S) -> object:
        self.sock.settimeout(timeout)
        send_frame(self.sock, msg)
        return parse_message(recv_frame(self.sock))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class KVSender:
    """Sends KV states to decode nodes in the allowlist over one transport."""

    def __init__(
        self,
        extra_config: ConnectorExtraConfig,
        layout: CacheLayout,
        staging: Buffer,
        *,
        sender_rank: int = 0,
        tp_size: int = 1,
        transport: TransportSender | None = None,
        name: str | None = None,
    ):
        self.config = extra_config
        self.layout = layout
        self.sender_rank = sender_rank
        self.tp_size = tp_size
        self.transport = transport or make_sender(
            extra_config.transport, name=name or f"tilepd-prefill-{socket.gethostname()}-r{sender_rank}",
            connect_timeout_s=extra_config.connect_timeout_s,
        )
        if self.transport.name != extra_config.transport.name:
            raise ValueError(f"transport {self.transport.name!r} given but config names {extra_config.transport.name!r}")
        self.transport.register(staging)
        self.staging = staging
        self._staging_bytes = _host_bytes(staging)
        self._allowed = {(e.host, e.ctrl_port) for e in extra_config.decode_allowlist}
        self._channels: dict[tuple[str, int], _Channel] = {}
        self._channels_lock = threading.Lock()
        self._endpoint_locks: dict[tuple[str, int], threading.Lock] = {}

    # -- public ---------------------------------------------------------------------
    def hello_message(self) -> Hello:
        """What this sender says in hello (exposed so the connector can log it)."""
        return Hello(
            protocol=PROTOCOL_VERSION,
            layout=self.layout,
            transport=TransportInfo(name=self.transport.name, metadata=self.transport.describe()),
            max_seq_len=self.config.max_seq_len,
            sender_rank=self.sender_rank,
            tp_size=self.tp_size,
            tilepd_version=__version__,
        )

    def is_allowed(self, host: str, ctrl_port: int) -> bool:
        return (host, int(ctrl_port)) in self._allowed

    def send(
        self,
        endpoint: EndpointLike,
        transfer_id: str,
        token: str,
        seq_len: int,
        num_blocks: int,
        src: Sequence[SourceSpec],
    ) -> SendResult:
        t0 = time.perf_counter()
        key = (endpoint.host, endpoint.ctrl_port) if isinstance(endpoint, DecodeEndpoint) else (endpoint[0], int(endpoint[1]))
        res = SendResult(ok=False, transfer_id=transfer_id)
        try:
            if key not in self._allowed:
                return self._fail(res, "not_allowed", f"decode node {key[0]}:{key[1]} is not in the connector's decode_allowlist", t0)
            if seq_len > self.config.max_seq_len:
                return self._fail(res, ErrorCode.TOO_LONG.value, f"seq_len {seq_len} exceeds max_seq_len {self.config.max_seq_len}", t0)
            if num_blocks != self.layout.blocks_for(seq_len):
                return self._fail(res, "bad_request", f"num_blocks {num_blocks} != ceil({seq_len}/{self.layout.block_size})", t0)
            n_regions = self.layout.num_layers + (len(self.layout.indexer.layers) if self.layout.indexer else 0)
            if len(src) != n_regions:
                return self._fail(res, "bad_request", f"{len(src)} source regions given for {n_regions} regions "
                                  f"({self.layout.num_layers} layers{' + indexer layers' if self.layout.indexer else ''})", t0)
            with self._endpoint_lock(key):
                return self._send_locked(key, res, transfer_id, token, seq_len, num_blocks, src, t0)
        except ProtocolError as exc:
            return self._fail(res, exc.code.value, exc.message, t0)
        except (OSError, FrameError, TransportError) as exc:
            self._drop(key)
            return self._fail(res, "transport" if isinstance(exc, TransportError) else "connect",
                              f"{key[0]}:{key[1]}: {type(exc).__name__}: {exc}", t0)

    def close(self) -> None:
        with self._channels_lock:
            chans = list(self._channels.values())
            self._channels.clear()
        for ch in chans:
            ch.close()
        self.transport.close()

    # -- internals ------------------------------------------------------------------
    def _endpoint_lock(self, key: tuple[str, int]) -> threading.Lock:
        with self._channels_lock:
            return self._endpoint_locks.setdefault(key, threading.Lock())

    def _fail(self, res: SendResult, code: str, message: str, t0: float) -> SendResult:
        res.ok, res.code, res.message = False, code, message
        res.timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        log.warning("event=send_failed transfer_id=%s code=%s attempts=%d message=%s", res.transfer_id, code, res.attempts, message)
        return res

    def _drop(self, key: tuple[str, int]) -> None:
        with self._channels_lock:
            ch = self._channels.pop(key, None)
        if ch is not None:
            ch.close()
            try:
                self.transport.disconnect(ch.peer)
            except TransportError:
                pass

    def _channel(self, key: tuple[str, int], res: SendResult) -> _Channel:
        with self._channels_lock:
            ch = self._channels.get(key)
        if ch is not None:
            return ch
        t = time.perf_counter()
        sock = socket.create_connection(key, timeout=self.config.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(REPLY_TIMEOUT_S)
            send_frame(sock, dump(self.hello_message(), exclude_none=True))
            try:
                reply = parse_message(recv_frame(sock))
            except PeerClosed as exc:
                raise PeerClosed(
                    f"the decode node closed the connection without answering hello ({exc}); if it runs a tilepd older "
                    f"than {MIN_TILEPD_FOR_PROTOCOL} (control protocol < {PROTOCOL_VERSION}) it cannot read this hello "
                    f"(layout {self.layout.layout_id}): upgrade the decode node to tilepd >= {MIN_TILEPD_FOR_PROTOCOL}"
                ) from exc
            if isinstance(reply, Error):
                raise ProtocolError(reply.code, reply.message)
            if not isinstance(reply, HelloOk):
                raise ProtocolError(ErrorCode.MALFORMED, f"expected hello_ok, got {type(reply).__name__}")
            check_hello_ok(reply, transport=self.transport.name)
            peer = self.transport.connect(reply.transport.metadata)
        except BaseException:
            sock.close()
            raise
        ch = _Channel(sock, reply, peer)
        with self._channels_lock:
            self._channels[key] = ch
        res.timings["hello_ms"] = (time.perf_counter() - t) * 1e3
        log.info("event=hello_ok peer=%s:%d node=%s layout=%s transport=%s", key[0], key[1], reply.node, self.layout.layout_id, self.transport.name)
        return ch

    def _region_plan(self, accept: Accept, seq_len: int) -> list[tuple[str, int, int, int, int]]:
        """(segment, layer, dst offset, num_blocks, block_bytes) per region, in `CacheLayout.regions` order."""
        lay, dst = self.layout, accept.dst
        if dst.block_bytes != lay.block_bytes:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"decode node expects {dst.block_bytes}-byte blocks, this layout has {lay.block_bytes}")
        nb = lay.blocks_for(seq_len)
        plan = [("kv", l, dst.base + l * dst.region_stride, nb, lay.block_bytes) for l in range(lay.num_layers)]
        if lay.indexer is not None:
            ix, idst = lay.indexer, dst.indexer
            if idst is None or idst.block_bytes != ix.block_bytes:
                raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"decode node gave no indexer region with {ix.block_bytes}-byte blocks "
                                    f"(got {idst}); this layout ships indexer keys ({lay.layout_id})")
            plan += [("indexer", l, idst.base + j * idst.region_stride, ix.blocks_for(seq_len), ix.block_bytes)
                     for j, l in enumerate(ix.layers)]
        return plan

    def _segments(self, plan: list[tuple[str, int, int, int, int]], src: Sequence[SourceSpec]) -> list[Segment]:
        segs: list[Segment] = []
        for (seg, layer, dst0, nb, bb), spec in zip(plan, src):
            if isinstance(spec, int):
                segs.append(Segment(spec, dst0, nb * bb))
            else:
                if len(spec) != nb:
                    raise ProtocolError(ErrorCode.MALFORMED, f"{seg} layer {layer}: {len(spec)} block offsets for {nb} blocks")
                segs.extend(Segment(int(off), dst0 + i * bb, bb) for i, off in enumerate(spec))
        return segs

    def _digests(self, plan: list[tuple[str, int, int, int, int]], src: Sequence[SourceSpec]) -> list[str]:
        """xxh3_64 of each region's bytes as staged, in region order (what the decode node must find)."""
        whole = [(spec, nb * bb) for (_, _, _, nb, bb), spec in zip(plan, src) if isinstance(spec, int)]
        if len(whole) == len(plan):
            return region_digests(self._staging_bytes, whole)
        out = []
        for (_, _, _, nb, bb), spec in zip(plan, src):
            h = xxhash.xxh3_64()
            for off in ([spec] if isinstance(spec, int) else spec):
                n = nb * bb if isinstance(spec, int) else bb
                h.update(self._staging_bytes[int(off):int(off) + n].numpy())
            out.append(f"{h.intdigest():016x}")
        return out

    def _wait_wire(self, ch: _Channel, handle: WriteHandle, transfer_id: str) -> int:
        """Wait for the write; abort it at once if the decode node closes our control connection (it revoked
        the transfer: timeout or cancel), so a one-sided writer does not land bytes in a slot that moved on."""
        deadline = time.monotonic() + WIRE_TIMEOUT_S
        while not handle.finished(0.002):
            readable, _, _ = select.select([ch.sock], [], [], 0)
            if readable:
                handle.abort()
                handle.finished(5.0)
                raise _Revoked(f"transfer {transfer_id}: the decode node revoked the transfer (closed the control "
                                     "connection mid-write); write aborted")
            if time.monotonic() > deadline:
                handle.abort()
                raise TransportError(f"transfer {transfer_id}: write did not complete within {WIRE_TIMEOUT_S:g} s")
        return handle.wait(0)

    def _send_locked(self, key: tuple[str, int], res: SendResult, transfer_id: str, token: str, seq_len: int, num_blocks: int,
                     src: Sequence[SourceSpec], t0: float) -> SendResult:
        admit = dump(Admit(transfer_id=transfer_id, token=token, seq_len=seq_len, num_blocks=num_blocks, sender_rank=self.sender_rank))
        backoff = self.config.busy_backoff_s
        reconnected = False
        t_admit = time.perf_counter()
        while True:
            ch = self._channel(key, res)
            res.attempts += 1
            try:
                reply = ch.call(admit)
            except (OSError, FrameError) as exc:
                # the node may have restarted since our cached hello: one fresh connection
                self._drop(key)
                if reconnected:
                    raise
                log.info("event=reconnect transfer_id=%s peer=%s:%d reason=%s", transfer_id, key[0], key[1], exc)
                reconnected = True
                res.attempts -= 1
                continue
            if isinstance(reply, Accept):
                break
            if isinstance(reply, Error):
                self._drop(key)
                raise ProtocolError(reply.code, reply.message)
            if not isinstance(reply, Reject):
                self._drop(key)
                raise ProtocolError(ErrorCode.MALFORMED, f"expected accept or reject, got {type(reply).__name__}")
            if not reply.retryable:
                raise ProtocolError(reply.code, reply.message)
            if res.attempts > self.config.busy_retries:
                res.timings["admit_ms"] = (time.perf_counter() - t_admit) * 1e3
                log.warning("event=give_up transfer_id=%s peer=%s:%d reason=busy attempts=%d", transfer_id, key[0], key[1], res.attempts)
                return self._fail(res, reply.code.value, f"decode node {key[0]}:{key[1]} stayed busy after {res.attempts} attempts: {reply.message}", t0)
            log.info("event=busy_retry transfer_id=%s peer=%s:%d attempt=%d backoff_s=%.3f", transfer_id, key[0], key[1], res.attempts, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        res.generation = accept_gen = reply.generation
        res.timings["admit_ms"] = (time.perf_counter() - t_admit) * 1e3
        log.info("event=accepted transfer_id=%s peer=%s:%d generation=%d", transfer_id, key[0], key[1], accept_gen)

        t_wire = time.perf_counter()
        error: str | None = None
        nbytes = 0
        digests: list[str] = []
        try:
            plan = self._region_plan(reply, seq_len)
            segs = self._segments(plan, src)
            # the write's name carries the rank: a receiver tells the ranks' writes of one transfer apart
            handle = self.transport.write(ch.peer, segs, generation=accept_gen, transfer_id=f"{transfer_id}/{self.sender_rank}")
            t_sum = time.perf_counter()
            digests = self._digests(plan, src)  # while the write is in flight (the staged bytes do not change)
            res.timings["checksum_ms"] = (time.perf_counter() - t_sum) * 1e3
            nbytes = self._wait_wire(ch, handle, transfer_id)
        except _Revoked as exc:
            res.timings["wire_ms"] = (time.perf_counter() - t_wire) * 1e3
            self._drop(key)
            return self._fail(res, "revoked", str(exc), t0)
        except (TransportError, ProtocolError) as exc:
            error = str(exc)
        res.timings["wire_ms"] = (time.perf_counter() - t_wire) * 1e3

        t_done = time.perf_counter()
        ack = ch.call(dump(Done(transfer_id=transfer_id, generation=accept_gen, bytes=nbytes, ok=error is None, error=error,
                                checksums=digests if error is None else [])))
        res.timings["done_ms"] = (time.perf_counter() - t_done) * 1e3
        if isinstance(ack, Error):
            self._drop(key)
            raise ProtocolError(ack.code, ack.message)
        if not isinstance(ack, Ack):
            self._drop(key)
            raise ProtocolError(ErrorCode.MALFORMED, f"expected ack, got {type(ack).__name__}")
        if error is not None:
            return self._fail(res, "transport", error, t0)
        if not ack.ok:
            code = ErrorCode.KV_CHECKSUM_MISMATCH if ack.message.startswith(ErrorCode.KV_CHECKSUM_MISMATCH.value) else ErrorCode.UNKNOWN_TRANSFER
            return self._fail(res, code.value, ack.message or "decode node did not take the transfer", t0)
        res.ok, res.bytes = True, nbytes
        res.timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        wire_s = res.timings["wire_ms"] / 1e3
        log.info("event=sent transfer_id=%s peer=%s:%d bytes=%d wire_ms=%.2f gbps=%.2f", transfer_id, key[0], key[1], nbytes,
                 res.timings["wire_ms"], nbytes / wire_s / 1e9 if wire_s > 0 else 0.0)
        return res


def _host_bytes(buf: Buffer) -> torch.Tensor:
    """The staging buffer's bytes as a flat uint8 tensor (what the checksums read)."""
    owner = buf.owner
    if isinstance(owner, torch.Tensor) and owner.is_contiguous():
        return owner.reshape(-1).view(torch.uint8)
    if isinstance(owner, np.ndarray) and owner.flags["C_CONTIGUOUS"]:
        return torch.from_numpy(owner.reshape(-1).view(np.uint8))
    return torch.frombuffer(buf.memoryview(), dtype=torch.uint8)
