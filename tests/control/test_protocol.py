"""Control protocol over real sockets: mismatches, malformed input, busy, killed senders, stale writers."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tilepd.control.framing import encode_frame, recv_frame, send_frame
from tilepd.control.cache_layout import CacheLayout
from tilepd.contracts.fingerprint import CheckpointIdentity, Fingerprint
from tilepd.control.messages import MIN_TILEPD_FOR_PROTOCOL, PROTOCOL_VERSION, dump
from tilepd.control.sender import KVSender
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.runtime.ctrl_server import ControlServer
from tilepd.runtime.geometry import CacheGeometry
from tilepd.runtime.slot import State
from tilepd.transport import Buffer, TransportError
from tilepd.transport.tcp import TcpSender

from tests.reserved import reserve_and_attach

from .harness import close_control_node, start_control_node

MAX = 256
GEOM = CacheGeometry("llama", "attn", num_layers=2, num_heads=2, entry_width=64, head_size_k=32, head_size_v=32)
LAYOUT = CacheLayout(kind="attn", num_layers=2, block_size=16, num_heads=2, entry_width=64, dtype="float32",
                     head_size_k=32, head_size_v=32)


@pytest.fixture
def node():
    n = start_control_node(GEOM, MAX)
    yield n
    close_control_node(n)


def _config(port: int, **kw) -> ConnectorExtraConfig:
    return ConnectorExtraConfig(
        decode_allowlist=(DecodeEndpoint(name="n0", host="127.0.0.1", ctrl_port=port, http_port=1),),
        transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=MAX, **kw)


def _payload(layout: CacheLayout, seq_len: int, seed: int = 0) -> tuple[np.ndarray, int]:
    nb = layout.blocks_for(seq_len)
    return np.random.default_rng(seed).integers(0, 256, layout.num_layers * nb * layout.block_bytes, dtype=np.uint8), nb


def _send_and_check(node, sender: KVSender, staging: np.ndarray, tid: str, seq_len: int, nb: int):
    """Reserve the slot unless `tid` holds it already (what the router does before the prefill), then send the KV."""
    if node.slot.current is None or node.slot.current.transfer_id != tid:
        node.slot.reserve(tid, "tok")
    bb = LAYOUT.block_bytes
    r = sender.send(("127.0.0.1", node.port), tid, "tok", seq_len, nb, [l * nb * bb for l in range(LAYOUT.num_layers)])
    assert r.ok, r
    stride = LAYOUT.region_stride(MAX)
    for l in range(LAYOUT.num_layers):
        assert (node.buf[l * stride:l * stride + nb * bb] == staging[l * nb * bb:(l + 1) * nb * bb]).all()
    return r


def _hello(**over) -> dict:
    msg = {"type": "hello", "protocol": PROTOCOL_VERSION, "layout": LAYOUT.model_dump(mode="json"), "transport": {"name": "tcp", "metadata": {}},
           "max_seq_len": MAX, "sender_rank": 0, "tp_size": 1}
    msg.update(over)
    return msg


def _call(port: int, msg: dict) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        send_frame(s, msg)
        return recv_frame(s)


def _closed(s: socket.socket) -> bool:
    """True when the peer closed (an error frame before the close is allowed)."""
    s.settimeout(5)
    try:
        for _ in range(100):
            if s.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    return False


def test_transfer_lands_and_hello_is_cached(node) -> None:
    staging, nb = _payload(LAYOUT, 40)
    sender = KVSender(_config(node.port), LAYOUT, Buffer.from_array(staging))
    r1 = _send_and_check(node, sender, staging, "t1", 40, nb)
    assert "hello_ms" in r1.timings and r1.bytes == staging.nbytes
    node.slot.release(node.slot.current)
    r2 = _send_and_check(node, sender, staging, "t2", 40, nb)
    assert "hello_ms" not in r2.timings  # one hello per connection
    sender.close()


def test_version_mismatch_says_what_to_upgrade(node) -> None:
    reply = _call(node.port, _hello(protocol=PROTOCOL_VERSION + 1, tilepd_version="9.9"))
    assert reply["type"] == "error" and reply["code"] == "version_mismatch"
    assert "upgrade tilepd on the decode node" in reply["message"] and "9.9" in reply["message"]


# What a protocol-1 connector (tilepd before the indexer/checksum change) sent: these exact keys.
V1_HELLO = {"type": "hello", "protocol": 1, "transport": {"name": "tcp", "metadata": {}}, "max_seq_len": MAX, "sender_rank": 0,
            "tp_size": 1, "tilepd_version": "0.1.0",
            "layout": {"kind": "attn", "layout_version": 1, "num_layers": 2, "block_size": 16, "num_heads": 2, "entry_width": 64,
                       "dtype": "float32", "order": "BHNC", "head_size_k": 32, "head_size_v": 32, "kv_lora_rank": None, "rope_dim": None}}
V1_LAYOUT_KEYS = set(V1_HELLO["layout"])


def test_a_protocol_1_connector_is_told_to_upgrade_the_prefill_hosts(node) -> None:
    reply = _call(node.port, V1_HELLO)
    assert reply["type"] == "error" and reply["code"] == "version_mismatch", reply
    assert "speaks control protocol 1" in reply["message"]
    assert "upgrade the prefill hosts (the vLLM connector) to tilepd >= " in reply["message"]
    assert f"control protocol {PROTOCOL_VERSION}" in reply["message"]


def test_a_v2_hello_without_indexer_has_only_v1_keys() -> None:
    """A protocol-1 decode node validates hello with extra keys forbidden and checks the protocol number first:
    a v2 hello with v1's keys reaches that check, so the old node itself answers 'upgrade the decode node'."""
    staging, _ = _payload(LAYOUT, 10)
    sender = KVSender(_config(1), LAYOUT, Buffer.from_array(staging))
    hello = dump(sender.hello_message(), exclude_none=True)
    sender.close()
    assert set(hello) <= set(V1_HELLO) and set(hello["layout"]) <= V1_LAYOUT_KEYS
    assert hello["protocol"] == PROTOCOL_VERSION


def _fingerprint(role: str, weights: str) -> Fingerprint:
    return Fingerprint(role=role, checkpoint=CheckpointIdentity(weights=weights, config="c" * 64, tokenizer="t" * 64),  # type: ignore[arg-type]
                       facts={"vllm_version": "0.32.0"} if role == "prefill" else {"converter_version": "2"})


def test_a_prefill_of_another_checkpoint_is_refused_at_hello_before_any_byte_moves() -> None:
    node_fp, prefill_fp = _fingerprint("decode", "b" * 64), _fingerprint("prefill", "a" * 64)
    n = start_control_node(GEOM, MAX, name="d3", fingerprint=node_fp)
    try:
        staging, nb = _payload(LAYOUT, 40)
        sender = KVSender(_config(n.port), LAYOUT, Buffer.from_array(staging), fingerprint=prefill_fp)
        r = sender.send(("127.0.0.1", n.port), "t-fp", "tok", 40, nb, [l * nb * LAYOUT.block_bytes for l in range(LAYOUT.num_layers)])
        sender.close()
        assert not r.ok and r.code == "fingerprint_mismatch", r
        assert prefill_fp.id in r.message and node_fp.id in r.message and "decode node d3" in r.message and "differ in weights" in r.message
        assert "RB-fingerprint-mismatch" in r.message
        assert n.slot.transfers_total == 0 and not n.buf.any()  # refused at the hello: no admit, no byte
        # the same checkpoint pairs, and hello_ok carries the node's fingerprint
        same = KVSender(_config(n.port), LAYOUT, Buffer.from_array(staging), fingerprint=node_fp.model_copy(update={"role": "prefill"}))
        _send_and_check(n, same, staging, "t-same", 40, nb)
        assert next(iter(same._channels.values())).hello_ok.fingerprint == node_fp
        same.close()
    finally:
        close_control_node(n)


def test_a_protocol_2_connector_is_told_to_upgrade_the_prefill_hosts(node) -> None:
    reply = _call(node.port, _hello(protocol=2, tilepd_version="0.2.0"))
    assert reply["type"] == "error" and reply["code"] == "version_mismatch", reply
    assert "(tilepd 0.2.0) speaks control protocol 2" in reply["message"]
    assert f"to tilepd >= {MIN_TILEPD_FOR_PROTOCOL} with control protocol {PROTOCOL_VERSION}" in reply["message"]


def test_a_node_that_hangs_up_on_hello_gets_an_upgrade_hint() -> None:
    """A protocol-1 node cannot parse a hello with an indexer segment and closes without a reply."""
    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]

    def old_node() -> None:
        c, _ = lst.accept()
        recv_frame(c)
        c.close()

    threading.Thread(target=old_node, daemon=True).start()
    staging, nb = _payload(LAYOUT, 10)
    r = KVSender(_config(port), LAYOUT, Buffer.from_array(staging)).send(("127.0.0.1", port), "t", "k", 10, nb, [0, 0])
    lst.close()
    assert not r.ok and r.code == "connect" and "upgrade the decode node to tilepd >=" in r.message, r


def test_transport_mismatch_says_what_to_change(node) -> None:
    reply = _call(node.port, _hello(transport={"name": "nixl", "metadata": {}}))
    assert reply["code"] == "transport_mismatch" and "transport.name" in reply["message"]


def test_layout_mismatch_from_the_sender_side(node) -> None:
    wrong = LAYOUT.model_copy(update={"num_heads": 4})
    staging, nb = _payload(wrong, 10)
    r = KVSender(_config(node.port), wrong, Buffer.from_array(staging)).send(("127.0.0.1", node.port), "t", "k", 10, nb, [0, 0])
    assert not r.ok and r.code == "layout_mismatch" and "4 KV heads" in r.message and "has 2" in r.message
    old = LAYOUT.model_copy(update={"layout_version": 0})
    assert _call(node.port, _hello(layout=old.model_dump(mode="json")))["code"] == "layout_mismatch"


def test_sender_refuses_an_old_decode_node() -> None:
    """The connector side checks hello_ok too (a one-shot fake node answering protocol 0)."""
    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]

    def fake_node() -> None:
        c, _ = lst.accept()
        recv_frame(c)
        send_frame(c, {"type": "hello_ok", "protocol": 0, "transport": {"name": "tcp", "metadata": {}}, "regions": [], "busy": False})
        c.close()

    threading.Thread(target=fake_node, daemon=True).start()
    staging, nb = _payload(LAYOUT, 10)
    r = KVSender(_config(port), LAYOUT, Buffer.from_array(staging)).send(("127.0.0.1", port), "t", "k", 10, nb, [0, 0])
    lst.close()
    assert r.code == "version_mismatch" and "upgrade the decode node to tilepd >=" in r.message


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack(">I", 50 << 20),  # oversized length
        struct.pack(">I", 5) + b"nope!",  # not JSON
        encode_frame({"type": "admit", "transfer_id": "t", "token": "k", "seq_len": 1, "num_blocks": 1}),  # before hello
        encode_frame({"type": "accept", "transfer_id": "t", "generation": 1, "dst": {"base": 0, "region_stride": 0, "block_bytes": 0}}),
    ],
)
def test_malformed_input_closes_the_connection_and_spares_the_slot(node, garbage: bytes) -> None:
    staging, nb = _payload(LAYOUT, 40)
    # a transfer in progress on another connection must survive the garbage
    tr = reserve_and_attach(node.slot, "live", "tok")
    with socket.create_connection(("127.0.0.1", node.port)) as s:
        s.sendall(garbage)
        assert _closed(s)
    assert node.slot.state == State.RESERVED and node.slot.current is tr
    sender = KVSender(_config(node.port), LAYOUT, Buffer.from_array(staging))
    _send_and_check(node, sender, staging, "live", 40, nb)
    assert node.slot.state == State.COMPLETE
    sender.close()


def test_busy_is_retried_then_given_up_with_a_log_line(node, caplog) -> None:
    node.slot.reserve("someone-else", "x")
    staging, nb = _payload(LAYOUT, 10)
    sender = KVSender(_config(node.port, busy_retries=2, busy_backoff_s=0.01), LAYOUT, Buffer.from_array(staging))
    with caplog.at_level("INFO", logger="tilepd.control.sender"):
        r = sender.send(("127.0.0.1", node.port), "mine", "k", 10, nb, [0, nb * LAYOUT.block_bytes])
    assert not r.ok and r.code == "busy" and r.attempts == 3
    assert any("event=give_up transfer_id=mine" in m for m in caplog.messages)
    assert sum("event=busy_retry" in m for m in caplog.messages) == 2
    # once the slot frees, the same sender gets through
    node.slot.release(node.slot.current)
    _send_and_check(node, sender, staging, "mine", 10, nb)
    sender.close()


def test_busy_then_free_succeeds_within_retries(node) -> None:
    tr = node.slot.reserve("someone-else", "x")

    def hand_over() -> None:  # the slot frees and the next reservation is "mine" (its router reserved it)
        node.slot.release(tr)
        node.slot.reserve("mine", "tok")

    threading.Timer(0.1, hand_over).start()
    staging, nb = _payload(LAYOUT, 10)
    sender = KVSender(_config(node.port, busy_retries=20, busy_backoff_s=0.02), LAYOUT, Buffer.from_array(staging))
    bb = LAYOUT.block_bytes
    r = sender.send(("127.0.0.1", node.port), "mine", "tok", 10, nb, [l * nb * bb for l in range(LAYOUT.num_layers)])
    assert r.ok, r
    assert r.attempts > 1
    sender.close()


def test_not_allowed_endpoint_is_refused_without_connecting(node) -> None:
    staging, nb = _payload(LAYOUT, 10)
    r = KVSender(_config(node.port), LAYOUT, Buffer.from_array(staging)).send(("10.9.9.9", 5556), "t", "k", 10, nb, [0, 0])
    assert r.code == "not_allowed" and "decode_allowlist" in r.message


def test_stale_done_from_a_foreign_connection_is_ignored(node) -> None:
    reserve_and_attach(node.slot, "t1", "tok")
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        send_frame(s, _hello())
        assert recv_frame(s)["type"] == "hello_ok"
        send_frame(s, {"type": "admit", "transfer_id": "t1", "token": "tok", "seq_len": 10, "num_blocks": 1})
        acc = recv_frame(s)
        stale = {"type": "done", "transfer_id": "t1", "generation": acc["generation"] - 1, "bytes": 0, "ok": True}
        with socket.create_connection(("127.0.0.1", node.port), timeout=5) as foreign:
            send_frame(foreign, stale)  # no hello: refused and closed
            assert recv_frame(foreign)["code"] == "not_ready" and _closed(foreign)
        with socket.create_connection(("127.0.0.1", node.port), timeout=5) as foreign:
            send_frame(foreign, _hello())
            assert recv_frame(foreign)["type"] == "hello_ok"
            send_frame(foreign, stale)  # a late done of an older generation
            assert recv_frame(foreign)["ok"] is False
            send_frame(foreign, {**stale, "generation": acc["generation"]})  # right generation, but this connection never admitted
            assert recv_frame(foreign)["ok"] is False
        assert node.slot.state == State.TRANSFERRING
        # a bad token does not take the slot either
        send_frame(s, {"type": "admit", "transfer_id": "t1", "token": "nope", "seq_len": 10, "num_blocks": 1})
        rej = recv_frame(s)
        assert rej["type"] == "reject" and rej["code"] == "bad_token" and rej["retryable"] is False


@pytest.mark.slow
def test_sender_killed_mid_transfer_leaves_the_slot_reusable(node) -> None:
    tr = reserve_and_attach(node.slot, "victim", "tok")
    script = Path(__file__).with_name("stalled_sender.py")
    proc = subprocess.Popen([sys.executable, str(script), "127.0.0.1", str(node.port), LAYOUT.model_dump_json(), "victim", "tok",
                             "40", str(LAYOUT.blocks_for(40))], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stalled"
        assert node.slot.state == State.TRANSFERRING
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while node.slot.state != State.FREE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert node.slot.state == State.FREE and tr.failure and "closed mid-transfer" in tr.failure
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    staging, nb = _payload(LAYOUT, 40, seed=3)
    sender = KVSender(_config(node.port), LAYOUT, Buffer.from_array(staging))
    _send_and_check(node, sender, staging, "next", 40, nb)
    sender.close()


class _GatedSender(TcpSender):
    """FAULT INJECTION: a real tcp sender whose write waits for a gate, so the test can take the slot
    away while the write is in flight (a real write cannot be held mid-flight on demand)."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.gate = gate
        self.wrote = threading.Event()

    def write(self, peer, segments, *, generation, transfer_id):
        from tilepd.transport.base import ThreadHandle

        inner_write = super().write

        def run(abort: threading.Event) -> int:
            self.gate.wait(10)
            if abort.is_set():
                raise TransportError("aborted before writing")
            self.wrote.set()
            return inner_write(peer, segments, generation=generation, transfer_id=transfer_id).wait(10)

        return ThreadHandle(run, name="gated")


def test_revoked_transfer_aborts_the_in_flight_write(node) -> None:
    """Cancelling a transfer mid-write closes its control connection; the sender aborts before any byte lands."""
    gate = threading.Event()
    staging, nb = _payload(LAYOUT, 40)
    transport = _GatedSender(gate)
    sender = KVSender(_config(node.port), LAYOUT, Buffer.from_array(staging), transport=transport)
    out: list = []
    node.slot.reserve("rev", "tok")
    th = threading.Thread(target=lambda: out.append(sender.send(("127.0.0.1", node.port), "rev", "tok", 40, nb,
                                                                [0, nb * LAYOUT.block_bytes])))
    th.start()
    deadline = time.monotonic() + 10
    while node.slot.state != State.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.slot.cancel("rev")  # admit-only reservation: the slot frees at once and revokes the connection
    th.join(10)
    gate.set()
    res = out[0]
    assert not res.ok and res.code == "revoked" and "revoked" in res.message
    assert not transport.wrote.is_set() and not node.buf.any()
    # the sender reconnects and the next transfer goes through
    _send_and_check(node, sender, staging, "after", 40, nb)
    sender.close()


def test_a_longer_connector_limit_is_fine_until_a_request_does_not_fit(node) -> None:
    """Decode nodes may hold fewer tokens than the connector allows: refused per admit (too_long), not at hello."""
    staging, nb = _payload(LAYOUT, 40)
    cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n0", host="127.0.0.1", ctrl_port=node.port, http_port=1),),
                               transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=4 * MAX)
    sender = KVSender(cfg, LAYOUT, Buffer.from_array(staging))
    _send_and_check(node, sender, staging, "fits", 40, nb)
    node.slot.release(node.slot.current)
    long_nb = LAYOUT.blocks_for(MAX + 1)
    node.slot.reserve("long", "tok")
    r = sender.send(("127.0.0.1", node.port), "long", "tok", MAX + 1, long_nb, [0, 0])
    assert not r.ok and r.code == "too_long" and f"max_seq_len {MAX}" in r.message
    sender.close()


def test_sender_outside_allowed_senders_is_refused(node) -> None:
    """allowed_senders (the prefill hosts of the topology): any other address gets not_allowed and a closed socket."""
    srv = ControlServer(slot=node.slot, receiver=node.rx, max_seq_len=MAX, check_layout=lambda lay, tp: None,
                        allowed_senders=("10.77.0.1",)).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            reply = recv_frame(s)
            assert reply["code"] == "not_allowed" and "127.0.0.1" in reply["message"] and _closed(s)
        staging, nb = _payload(LAYOUT, 10)
        r = KVSender(_config(srv.port), LAYOUT, Buffer.from_array(staging)).send(("127.0.0.1", srv.port), "t", "k", 10, nb, [0, 0])
        assert not r.ok and r.code == "not_allowed"
    finally:
        srv.close()
    assert node.slot.state == State.FREE
