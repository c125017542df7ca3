"""What the per-region transfer checksums (xxh3_64, protocol 2) cost on the handoff's hot path.

    python bench/checksum_cost.py [--mb 256] [--layers 61] [--repeat 5]

Prints, as JSON lines:
1. `digest`: xxh3_64 throughput over host memory, one thread and through `region_digests` (the thread pool the
   decode node verifies with), as GB/s and ms per GB.
2. `handoff`: a real loopback tcp handoff (KVSender -> ControlServer + slot + TcpReceiver) of `--mb` MB split
   into `--layers` regions (fp8_ds_mla-sized), to a decode node verifying checksums and one that does not
   (`recv_bytes=None`), alternating, medians of `--repeat` rounds: each total handoff ms, the sender's hashing
   (overlapped with its write) and the receiver's verification, which sits on the request's path between the
   last byte landing and the transfer counting as complete.
Numbers depend on the machine's memory bandwidth and free cores; docs/PERFORMANCE.md records runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import xxhash

from tilepd.control.checksum import region_digests
from tilepd.control.cache_layout import CacheLayout
from tilepd.control.sender import KVSender
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.runtime.ctrl_server import ControlServer
from tilepd.runtime.slot import Slot
from tilepd.transport import Buffer
from tilepd.transport.tcp import TcpReceiver


def digest_rates(buf: torch.Tensor, regions: int, repeat: int) -> dict:
    n = buf.numel()
    arr = buf.numpy()
    one = []
    for _ in range(repeat):
        t = time.perf_counter()
        xxhash.xxh3_64_intdigest(arr)
        one.append(time.perf_counter() - t)
    step = n // regions
    pooled = []
    for _ in range(repeat):
        t = time.perf_counter()
        region_digests(buf, [(i * step, step) for i in range(regions)])
        pooled.append(time.perf_counter() - t)
    s1, sp = statistics.median(one), statistics.median(pooled)
    return {"bench": "digest", "bytes": n, "one_thread_gbps": n / s1 / 1e9, "one_thread_ms_per_gb": s1 * 1e3 / (n / 1e9),
            "pooled_gbps": n / sp / 1e9, "pooled_ms_per_gb": sp * 1e3 / (n / 1e9), "regions": regions}


def handoff(mb: int, layers: int, repeat: int) -> dict:
    """Two receivers (verifying and not) side by side; sends alternate between them so load changes hit both."""
    block = 64
    entry = 656  # fp8_ds_mla bytes per token
    tokens = max(block, (mb << 20) // (layers * entry) // block * block)
    lay = CacheLayout(kind="mla", num_layers=layers, block_size=block, num_heads=1, entry_width=entry, dtype="fp8_ds_mla",
                      kv_lora_rank=512, rope_dim=64)
    cap = lay.buffer_bytes(tokens)
    staging = np.random.default_rng(0).integers(0, 256, cap, dtype=np.uint8)
    nodes = {}
    for verify in (False, True):
        buf = np.zeros(cap, np.uint8)
        rx = TcpReceiver("127.0.0.1", 0)
        rx.register(Buffer.from_array(buf))
        slot = Slot(on_arm=rx.arm, on_disarm=rx.disarm)
        srv = ControlServer(slot=slot, receiver=rx, max_seq_len=tokens, check_layout=lambda l, tp: None,
                            recv_bytes=torch.from_numpy(buf) if verify else None).start()
        cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="n", host="127.0.0.1", ctrl_port=srv.port, http_port=1),),
                                   transport=TransportConfig(name="tcp"), model_family="deepseek_v3", max_seq_len=tokens)
        nodes[verify] = (rx, slot, srv, KVSender(cfg, lay, Buffer.from_array(staging)))
    totals: dict[bool, list[float]] = {False: [], True: []}
    sums, verify_ms = [], []
    src = [o for _, _, o, _ in lay.regions(tokens, tokens)]
    for i in range(repeat + 1):
        for verify in ((False, True) if i % 2 else (True, False)):
            rx, slot, srv, sender = nodes[verify]
            slot.reserve(f"t{i}", "k", "bench")
            tr = slot.attach_decode(f"t{i}", "k", slot.current.reservation.fence)
            r = sender.send(("127.0.0.1", srv.port), f"t{i}", "k", tokens, lay.blocks_for(tokens), src)
            assert r.ok, r
            slot.wait_complete(tr, 30)
            slot.release(tr)
            if i:  # the first round warms connections and page mappings
                totals[verify].append(r.timings["total_ms"])
                sums.append(r.timings.get("checksum_ms", 0.0))
                if verify:
                    verify_ms.append(srv.last_verify_ms)
    for rx, slot, srv, sender in nodes.values():
        sender.close()
        srv.close()
        rx.close()
    nbytes = lay.transfer_bytes(tokens)
    v = statistics.median(verify_ms)
    return {"bench": "handoff", "layers": layers, "tokens": tokens, "bytes": nbytes,
            "unverified_total_ms": statistics.median(totals[False]), "verified_total_ms": statistics.median(totals[True]),
            "sender_checksum_ms": statistics.median(sums), "receiver_verify_ms": v, "receiver_verify_ms_per_gb": v / (nbytes / 1e9)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    buf = torch.from_numpy(np.random.default_rng(1).integers(0, 256, a.mb << 20, dtype=np.uint8))
    print(json.dumps(digest_rates(buf, a.layers, a.repeat)), flush=True)
    print(json.dumps(handoff(a.mb, a.layers, a.repeat)), flush=True)


if __name__ == "__main__":
    main()
