"""A real decode-side control server on loopback (tcp receiver, slot, layout check) for protocol tests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tilepd.contracts.fingerprint import Fingerprint
from tilepd.runtime.ctrl_server import ControlServer
from tilepd.runtime.geometry import CacheGeometry, check_layout, recv_buffer_bytes
from tilepd.runtime.slot import Slot
from tilepd.transport import Buffer
from tilepd.transport.tcp import TcpReceiver


def start_control_node(geom: CacheGeometry, max_seq_len: int, name: str = "n0", fingerprint: Fingerprint | None = None) -> SimpleNamespace:
    """buf (the receive buffer), rx, slot, srv and port of a started node (holding weights of `fingerprint`, when
    given); close it with close_control_node."""
    cap = recv_buffer_bytes(geom, max_seq_len, "auto", "cpu")
    buf = np.zeros(cap, np.uint8)
    rx = TcpReceiver("127.0.0.1", 0)
    rx.register(Buffer.from_array(buf))
    holder: list[ControlServer] = []
    slot = Slot(on_arm=rx.arm, on_disarm=rx.disarm, on_revoke=lambda conn_id: holder[0].revoke(conn_id))
    srv = ControlServer(slot=slot, receiver=rx, max_seq_len=max_seq_len, node_name=name, fingerprint=fingerprint,
                        check_layout=lambda lay, tp: check_layout(lay, geom, max_seq_len=max_seq_len, capacity=cap, tp_size=tp)).start()
    holder.append(srv)
    return SimpleNamespace(buf=buf, rx=rx, slot=slot, srv=srv, port=srv.port)


def close_control_node(node: SimpleNamespace) -> None:
    node.srv.close()
    node.rx.close()
