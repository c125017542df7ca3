"""A stopped decode node delays only its own transfers: the connector's sends to other nodes go on.

Before: one sender thread for all nodes, so a SIGSTOPped node (the kernel still accepts its
connections; nothing answers) held every later transfer for `REPLY_TIMEOUT_S` (30 s), and their
reserved slots timed out. The connector's worker half is driven without vLLM (as in
test_incremental_staging.py) but with its real send loop, a real KVSender over tcp, a real
decode-node control plane in this process and a real stopped process as the other node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from tilepd.contracts.marker import TilepdMarker
from tilepd.connector.staging import StagingPool
from tilepd.connector.vllm_connector import KVConnectorRole, SendSpec, TilePDConnector, _Staged
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.sender import REPLY_TIMEOUT_S, KVSender
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.runtime.geometry import CacheGeometry
from tilepd.runtime.slot import State
from tilepd.transport import Buffer

from tests.reserved import reserve_and_attach
from tests.waiting import wait_until

from ..control.harness import close_control_node, start_control_node

MAX = 256
SEQ = 40
GEOM = CacheGeometry("llama", "attn", num_layers=2, num_heads=2, entry_width=64, head_size_k=32, head_size_v=32)
LAYOUT = CacheLayout(kind="attn", num_layers=2, block_size=16, num_heads=2, entry_width=64, dtype="float32", head_size_k=32, head_size_v=32)
# a listening process that is then stopped: what a SIGSTOPped decode node's control port looks like
LISTENER = "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(8); print(s.getsockname()[1], flush=True); sys.stdin.read()"


def _job(c: TilePDConnector, port: int, tid: str) -> _Staged:
    slot = c._pool.acquire()
    assert slot is not None
    spec = SendSpec(tid, TilepdMarker(host="127.0.0.1", ctrl_port=port, transfer_id=tid, token="tok"), SEQ, [], 0, SEQ, True)
    return _Staged(spec, slot, time.perf_counter(), num_blocks=LAYOUT.blocks_for(SEQ))


def test_a_stopped_node_does_not_hold_up_the_transfer_to_another() -> None:
    stopped = subprocess.Popen([sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    live = start_control_node(GEOM, MAX, "live")
    buf, slot, srv = live.buf, live.slot, live.srv
    c = TilePDConnector.__new__(TilePDConnector)
    try:
        dead_port = int(stopped.stdout.readline())
        os.kill(stopped.pid, signal.SIGSTOP)
        cfg = ConnectorExtraConfig(
            decode_allowlist=(DecodeEndpoint(name="stopped", host="127.0.0.1", ctrl_port=dead_port, http_port=1),
                              DecodeEndpoint(name="live", host="127.0.0.1", ctrl_port=srv.port, http_port=2)),
            transport=TransportConfig(name="tcp"), model_family="llama", max_seq_len=MAX, connect_timeout_s=2.0)
        c._setup(cfg, KVConnectorRole.WORKER)
        c._pool = StagingPool(LAYOUT, MAX, num_slots=2)
        c._pool.buffer.copy_(torch.from_numpy(np.random.default_rng(1).integers(0, 256, c._pool.buffer.numel(), dtype=np.uint8)))
        c._sender = KVSender(cfg, LAYOUT, Buffer.from_array(c._pool.buffer))
        c._thread = threading.Thread(target=c._send_loop, daemon=True)
        c._thread.start()

        first, second = _job(c, dead_port, "to-stopped"), _job(c, srv.port, "to-live")
        reserve_and_attach(slot, "to-live", "tok")
        t0 = time.monotonic()
        c._jobs.put(first)  # queued first: with one sender thread the live node's transfer waited behind it
        c._jobs.put(second)
        assert wait_until(lambda: slot.state == State.COMPLETE, 10.0), f"live node's transfer not done: {slot.state}, {c.events.snapshot()}"
        took = time.monotonic() - t0
        assert took < REPLY_TIMEOUT_S / 3, took
        assert wait_until(lambda: c.events.snapshot()["sent"] == 1, 5.0)
        nb, bb = LAYOUT.blocks_for(SEQ), LAYOUT.block_bytes
        for l, off in enumerate(c._pool.region_offsets(second.slot)):
            got = buf[l * LAYOUT.region_stride(MAX):][: nb * bb]
            assert (got == c._pool.buffer[off:off + nb * bb].numpy()).all(), f"layer {l} bytes differ"
        # the stopped node's transfer is still waiting for its hello answer, holding only its own slot
        assert c._workers.pending() == {("127.0.0.1", dead_port): 1} and c._pool.free_slots() == 1
        stopped.kill()  # its sockets close: the waiting send fails at once and frees its slot
        assert wait_until(lambda: c._pool.free_slots() == 2, 10.0)
        assert c.events.snapshot()["failures"] == 1 and c._workers.pending() == {}
    finally:
        stopped.kill()
        stopped.wait()
        if c.__dict__.get("_thread") is not None:
            c.shutdown()
        close_control_node(live)



def test_jobs_of_one_node_run_in_order_and_close_waits_for_them() -> None:
    from tilepd.connector.peer_workers import PeerWorkers

    w, seen, gate = PeerWorkers("t"), [], threading.Event()
    w.submit("a", gate.wait, 5.0)
    for i in range(5):
        w.submit("a", seen.append, ("a", i))
        w.submit("b", seen.append, ("b", i))
    assert wait_until(lambda: len(seen) == 5, 5.0) and w.pending() == {"a": 6}  # b ran beside a's blocked job
    gate.set()
    assert w.close(5.0) and w.pending() == {}
    assert [x for x in seen if x[0] == "a"] == [("a", i) for i in range(5)]
