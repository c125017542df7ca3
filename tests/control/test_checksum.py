"""Transfer checksums (protocol 2) and the DSA indexer segment over real sockets (control server, slot, tcp).

The sender hashes each region it staged (xxh3_64), the decode node hashes what landed before the transfer
counts as complete. The fault a real transport cannot produce on demand, a byte changed in the receive
buffer after the data landed, is injected by `_FlipAfterReceive`, a TcpReceiver that flips one byte once
the real receive completed (the only fake here).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.reserved import reserve_and_attach
from tilepd.control.cache_layout import CacheLayout, IndexerLayout
from tilepd.control.sender import KVSender
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.runtime.ctrl_server import ControlServer
from tilepd.runtime.geometry import CacheGeometry, check_layout, recv_buffer_bytes
from tilepd.runtime.slot import Slot, SlotError, State
from tilepd.transport import Buffer
from tilepd.transport.tcp import TcpReceiver

MAX = 256
GEOM = CacheGeometry("deepseek_v3", "mla", num_layers=3, num_heads=1, entry_width=576, kv_lora_rank=512, rope_dim=64,
                     index_head_dim=128, indexer_layers=(0, 1))
LAYOUT = CacheLayout(kind="mla", num_layers=3, block_size=16, num_heads=1, entry_width=576, dtype="float32", kv_lora_rank=512,
                     rope_dim=64, indexer=IndexerLayout(layers=[0, 1], block_size=64, head_dim=128))
SEQ = 70


class _FlipAfterReceive(TcpReceiver):
    """Fault injection: once the real receive of a transfer completed, change one byte at `flip_at`."""

    flip_at: int | None = None
    buf: np.ndarray

    def wait_received(self, *a, **kw) -> bool:
        ok = super().wait_received(*a, **kw)
        if ok and self.flip_at is not None:
            self.buf[self.flip_at] ^= 0x40
        return ok


@pytest.fixture
def node():
    cap = recv_buffer_bytes(GEOM, MAX, "auto", "cpu")
    buf = np.zeros(cap, np.uint8)
    rx = _FlipAfterReceive("127.0.0.1", 0)
    rx.buf = buf
    rx.register(Buffer.from_array(buf))
    holder: list[ControlServer] = []
    slot = Slot(on_arm=rx.arm, on_disarm=rx.disarm, on_revoke=lambda conn_id: holder[0].revoke(conn_id))
    srv = ControlServer(slot=slot, receiver=rx, max_seq_len=MAX, node_name="n0", recv_bytes=torch.from_numpy(buf),
                        check_layout=lambda lay, tp: check_layout(lay, GEOM, max_seq_len=MAX, capacity=cap, tp_size=tp)).start()
    holder.append(srv)
    yield SimpleNamespace(buf=buf, rx=rx, slot=slot, srv=srv, port=srv.port)
    srv.close()
    rx.close()


def _sender(port: int, layout: CacheLayout = LAYOUT) -> tuple[KVSender, np.ndarray]:
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n0", host="127.0.0.1", ctrl_port=port, http_port=1),),
                               transport=TransportConfig(name="tcp"), model_family="deepseek_v3", max_seq_len=MAX)
    staging = np.random.default_rng(0).integers(0, 256, layout.buffer_bytes(MAX), dtype=np.uint8)
    return KVSender(cfg, layout, Buffer.from_array(staging)), staging


def _send(node, sender: KVSender, tid: str):
    stride, istride = LAYOUT.region_stride(MAX), LAYOUT.indexer.region_stride(MAX)
    src = [l * stride for l in range(3)] + [LAYOUT.indexer_base(MAX) + j * istride for j in range(2)]
    return sender.send(("127.0.0.1", node.port), tid, "tok", SEQ, LAYOUT.blocks_for(SEQ), src)


def test_both_segments_land_where_the_layout_says_and_verify(node) -> None:
    sender, staging = _sender(node.port)
    tr = reserve_and_attach(node.slot, "t1", "tok")
    r = _send(node, sender, "t1")
    sender.close()
    assert r.ok, r
    assert r.bytes == LAYOUT.transfer_bytes(SEQ) == 3 * 5 * 16 * 2304 + 2 * 2 * 64 * 132
    node.slot.wait_complete(tr, 5)
    for seg, layer, off, n in LAYOUT.regions(MAX, SEQ):  # the receive buffer mirrors the staging slot region by region
        assert (node.buf[off:off + n] == staging[off:off + n]).all(), (seg, layer)
    assert "checksum_ms" in r.timings and node.srv.checksum_failures == 0


@pytest.mark.parametrize("segment", ["kv", "indexer"])
def test_a_flipped_byte_fails_the_request_with_kv_checksum_mismatch(node, segment: str, caplog) -> None:
    regions = {(s, l): off for s, l, off, _ in LAYOUT.regions(MAX, SEQ)}
    node.rx.flip_at = regions[(segment, 1)] + 77
    sender, _ = _sender(node.port)
    tr = reserve_and_attach(node.slot, "t-bad", "tok")
    with caplog.at_level(logging.WARNING):
        r = _send(node, sender, "t-bad")
    assert not r.ok and r.code == "kv_checksum_mismatch", r
    assert f"{segment} region of layer 1" in r.message
    with pytest.raises(SlotError) as ei:  # the decode request fails with the typed code, nothing is decoded
        node.slot.wait_complete(tr, 5)
    assert ei.value.code == "kv_checksum_mismatch"
    assert node.slot.state == State.FREE and node.srv.checksum_failures == 1
    assert any("event=kv_checksum_mismatch" in m for m in caplog.messages)
    # the node takes the next transfer as usual
    node.rx.flip_at = None
    tr2 = reserve_and_attach(node.slot, "t-ok", "tok")
    assert _send(node, sender, "t-ok").ok
    node.slot.wait_complete(tr2, 5)
    sender.close()


def test_a_done_without_checksums_is_not_trusted(node, monkeypatch) -> None:
    """A sender that sends no digests (the stand-in: its digest step returns nothing) is refused."""
    sender, _ = _sender(node.port)
    monkeypatch.setattr(sender, "_digests", lambda plan, src: [])
    tr = reserve_and_attach(node.slot, "t-none", "tok")
    r = _send(node, sender, "t-none")
    sender.close()
    assert r.code == "kv_checksum_mismatch" and "sent 0 checksums for 5 regions" in r.message
    with pytest.raises(SlotError, match="0 checksums"):
        node.slot.wait_complete(tr, 5)


def test_a_dsa_node_refuses_a_layout_without_indexer_at_hello(node) -> None:
    no_ix = LAYOUT.model_copy(update={"indexer": None})
    sender, _ = _sender(node.port, no_ix)
    r = sender.send(("127.0.0.1", node.port), "t", "tok", SEQ, no_ix.blocks_for(SEQ), [0, 0, 0])
    sender.close()
    assert r.code == "layout_mismatch" and "no indexer segment" in r.message and "lightning indexer" in r.message
