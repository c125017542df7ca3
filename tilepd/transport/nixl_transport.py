"""NIXL (UCX backend) transport: one-sided RDMA WRITE from the staging buffer into the receive buffer.

Agent metadata travels in hello / hello_ok (base64), so no NIXL side channel or
etcd is needed. DRAM and VRAM both work (the memory type follows the buffer).
Each write carries a notification `tilepd:<transfer_id>:<generation>`; the
receiver counts a transfer as landed only when that notification arrives (it is
ordered after the data), so a `done` from a writer of another generation cannot
complete a slot. One-sided writes cannot be filtered by the target: a stale
writer is stopped by the control channel instead (the decode node closes the
connection of a transfer it revokes, and `KVSender` then aborts the in-flight
request: releasing a NIXL request that is still in progress aborts it).
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
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

log = logging.getLogger("tilepd.transport.nixl")

_POLL_S = 0.0002
_MAX_PENDING_NOTIFS = 4096
_RECEIVER_PROGRESS_S = 0.001  # the receiver's own progress period (~4% of a core when idle, measured)


def _agent(name: str, ucx_net_devices: str | None) -> Any:
    if ucx_net_devices:
        os.environ["UCX_NET_DEVICES"] = ucx_net_devices
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        raise TransportUnavailable(f"the nixl transport needs the nixl package (pip install 'tilepd[nixl]'): {exc}") from exc
    # No NIXL progress thread: the python binding sets its delay to 0, so it spins a whole core
    # even when idle (measured: 5.0 CPU-s per 5 s idle; two such agents starve a 2-core host).
    # Progress is driven by our own polls instead: check_xfer_state on the writer while a write
    # is in flight, and the receiver's progress thread below (UCX over TCP needs the target).
    # STRICT: the connector sends to several decode nodes from several threads at once (one per node)
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
    if "UCX" not in agent.backends:
        raise TransportUnavailable("NIXL loaded but its UCX backend did not: check the UCX plugin of the nixl wheel")
    return agent


def _mem(buf: Buffer) -> str:
    return "VRAM" if buf.device == "cuda" else "DRAM"


def _notif(transfer_id: str, generation: int) -> bytes:
    return f"tilepd:{transfer_id}:{generation}".encode()


class NixlPeer(Peer):
    def __init__(self, agent: str, addr: int, nbytes: int, mem: str, dev: int):
        self.agent, self.addr, self.nbytes, self.mem, self.dev = agent, addr, nbytes, mem, dev


class NixlSender(TransportSender):
    name = "nixl"

    def __init__(self, name: str = "tilepd-sender", ucx_net_devices: str | None = None):
        self.agent_name = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = _agent(self.agent_name, ucx_net_devices)
        self._buf: Buffer | None = None
        self._reg: Any = None
        self._lock = threading.Lock()

    def register(self, buf: Buffer) -> None:
        self._buf = buf
        self._reg = self.agent.register_memory([(buf.ptr, buf.nbytes, buf.device_id, "")], _mem(buf))

    def describe(self) -> dict[str, Any]:
        return {"agent": self.agent_name, "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def connect(self, peer_metadata: dict[str, Any]) -> NixlPeer:
        try:
            md = base64.b64decode(peer_metadata["metadata"])
            with self._lock:
                name = self.agent.add_remote_agent(md)
            name = name.decode() if isinstance(name, bytes) else str(name)
            try:  # set the UCX endpoint up now, not inside the first transfer's wire time
                self.agent.make_connection(name)
            except Exception as exc:  # noqa: BLE001 - the first write connects anyway
                log.info("event=nixl_preconnect_failed agent=%s reason=%s", name, exc)
            return NixlPeer(name, int(peer_metadata["addr"]), int(peer_metadata["nbytes"]), str(peer_metadata["mem"]),
                            int(peer_metadata.get("dev", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"nixl peer metadata needs agent, metadata, addr, nbytes and mem; got keys {sorted(peer_metadata)}") from exc

    def disconnect(self, peer: Peer) -> None:
        assert isinstance(peer, NixlPeer)
        try:
            with self._lock:
                self.agent.remove_remote_agent(peer.agent)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def write(self, peer: Peer, segments: Sequence[Segment], *, generation: int, transfer_id: str) -> WriteHandle:
        assert isinstance(peer, NixlPeer)
        buf, segs = self.staged_segments(self._buf, peer, segments)
        local = self.agent.get_xfer_descs([(buf.ptr + s.src, s.length, buf.device_id) for s in segs], _mem(buf))
        remote = self.agent.get_xfer_descs([(peer.addr + s.dst, s.length, peer.dev) for s in segs], peer.mem)
        total = sum(s.length for s in segs)
        notif = _notif(transfer_id, generation)

        def run(abort: threading.Event) -> int:
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer.agent, notif)
            try:
                state = self.agent.transfer(handle)
                while state == "PROC":
                    if abort.is_set():
                        raise TransportError(f"transfer {transfer_id}: write aborted")
                    time.sleep(_POLL_S)
                    state = self.agent.check_xfer_state(handle)
                if state != "DONE":
                    raise TransportError(f"transfer {transfer_id}: NIXL write to {peer.agent} failed ({state})")
                return total
            finally:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - an aborted request may refuse release; the agent reaps it
                    pass

        return ThreadHandle(run, name=f"nixl-write-{transfer_id}")

    def close(self) -> None:
        if self._reg is not None:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001
                pass
            self._reg = None


class NixlReceiver(TransportReceiver):
    name = "nixl"

    def __init__(self, name: str = "tilepd-receiver", ucx_net_devices: str | None = None):
        self.agent_name = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = _agent(self.agent_name, ucx_net_devices)
        self._buf: Buffer | None = None
        self._reg: Any = None
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._transfer_id = ""
        self._landed: set[bytes] = set()
        self._total = 0
        self._peers: set[str] = set()
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="nixl-rx-progress", daemon=True)
        self._progress.start()

    def _progress_loop(self) -> None:
        """Drive the UCX worker and collect write notifications until close()."""
        while not self._stop.wait(_RECEIVER_PROGRESS_S):
            try:
                with self._lock:
                    self._collect()
            except Exception as exc:  # noqa: BLE001 - a closing agent may refuse; the next wait_received retries
                log.debug("event=nixl_progress_error reason=%s", exc)

    def _collect(self) -> None:
        """Move new notifications into the landed set (caller holds the lock); stale ones are dropped at arm()."""
        for msgs in self.agent.get_new_notifs().values():
            self._landed.update(m for m in msgs if m.startswith(b"tilepd:"))
        if len(self._landed) > _MAX_PENDING_NOTIFS:  # bounded: keep only the armed transfer's notes
            armed = f"tilepd:{self._transfer_id}".encode()
            self._landed = {m for m in self._landed if m.startswith(armed)}

    def register(self, buf: Buffer) -> None:
        self._buf = buf
        self._reg = self.agent.register_memory([(buf.ptr, buf.nbytes, buf.device_id, "")], _mem(buf))

    def describe(self) -> dict[str, Any]:
        if self._buf is None:
            raise TransportError("no receive buffer registered")
        return {"agent": self.agent_name, "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "addr": self._buf.ptr, "nbytes": self._buf.nbytes, "mem": _mem(self._buf), "dev": self._buf.device_id}

    def add_peer(self, peer_metadata: dict[str, Any]) -> None:
        name = peer_metadata.get("agent")
        md = peer_metadata.get("metadata")
        if not name or not md or name in self._peers:
            return
        try:
            with self._lock:
                self.agent.add_remote_agent(base64.b64decode(md))
            self._peers.add(name)
        except Exception as exc:  # noqa: BLE001 - notifications still arrive without it
            log.info("event=nixl_add_peer_failed agent=%s reason=%s", name, exc)

    def arm(self, generation: int, transfer_id: str, limit: int) -> None:
        with self._lock:
            self._generation, self._transfer_id = generation, transfer_id
            self._landed.clear()

    def disarm(self) -> None:
        with self._lock:
            self._generation = None

    def wait_received(self, generation: int, nbytes: int, timeout: float, key: str = "") -> bool:
        want = _notif(key or self._transfer_id, generation)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._generation != generation:
                    return False
                self._collect()
                if want in self._landed:
                    self._landed.discard(want)
                    self._total += nbytes
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)

    def bytes_received(self) -> int:
        return self._total

    def close(self) -> None:
        self._stop.set()
        if self._progress is not threading.current_thread():
            self._progress.join(timeout=1.0)
        if self._reg is not None:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001
                pass
            self._reg = None
