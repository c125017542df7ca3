"""A receive-only decode node (no engine), for transport benchmarks.

It runs the real control server, slot and receiver, accepts any layout that fits
its buffer, and frees the slot as soon as a transfer completes, so a sender can
measure the whole handoff (hello, admit, wire, done) back to back without a model.
`python -m tilepd.runtime.sink --transport nixl --nbytes N` prints its control
port as one JSON line and serves until stdin closes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import numpy as np
import torch

from tilepd.control.cache_layout import CacheLayout
from tilepd.control.messages import ErrorCode, ProtocolError
from tilepd.contracts.service_configs import TransportConfig
from tilepd.runtime.ctrl_server import ControlServer
from tilepd.runtime.slot import Slot
from tilepd.transport.base import Buffer
from tilepd.transport.registry import make_receiver


class _AutoFreeSlot(Slot):
    """Frees itself the moment a transfer completes (before the sender's ack), so back-to-back sends never see busy."""

    def complete(self, transfer_id: str, generation: int, ok: bool, error: str | None = None, **kw: Any) -> tuple[bool, str]:
        accepted, msg = super().complete(transfer_id, generation, ok, error, **kw)
        cur = self.current
        if accepted and cur is not None:
            self.release(cur, "sink")
        return accepted, msg


def run_sink(transport: str, nbytes: int, max_seq_len: int) -> None:
    # stdout carries the one JSON line; anything a library prints (NIXL logs) goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    buf = np.zeros(nbytes, dtype=np.uint8)
    rx = make_receiver(TransportConfig(name=transport), bind_host="127.0.0.1", advertise_host="127.0.0.1", name="tilepd-sink")  # type: ignore[arg-type]
    rx.register(Buffer.from_array(buf))
    slot = _AutoFreeSlot(on_arm=rx.arm, on_disarm=rx.disarm)

    def check(layout: CacheLayout, tp_size: int) -> None:
        if layout.buffer_bytes(max_seq_len) * tp_size > nbytes:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, f"layout needs {layout.buffer_bytes(max_seq_len)} bytes, sink has {nbytes}")

    srv = ControlServer(slot=slot, receiver=rx, max_seq_len=max_seq_len, check_layout=check, node_name="sink",
                        recv_bytes=torch.from_numpy(buf)).start()
    print(json.dumps({"ctrl_port": srv.port}), file=out, flush=True)
    sys.stdin.read()
    srv.close()
    rx.close()


if __name__ == "__main__":
    import argparse

    logging.basicConfig(level=logging.WARNING)
    ap = argparse.ArgumentParser(prog="python -m tilepd.runtime.sink")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--nbytes", type=int, required=True)
    ap.add_argument("--max-seq-len", type=int, required=True)
    a = ap.parse_args()
    run_sink(a.transport, a.nbytes, a.max_seq_len)
