"""KV handoff wire time through tilepd's control protocol vs the transport's raw bandwidth, same run.

For each transport (tcp, nixl) a receive-only decode node (`python -m tilepd.runtime.sink`,
real control server, slot and receiver, no engine) runs in its own process; this process
sends 1K/8K/32K-token KV states with the real `KVSender` (hello cached, admit, write,
done) and then measures the transport's raw rate for the 32K state's size with
`tilepd.transport.bench.raw_bandwidth`. Printed: per size the median wire time, the
whole send (admit + wire + done), and wire rate / raw rate.

    .venv/bin/python bench/transport.py [--transports tcp nixl] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import numpy as np

from tilepd.control.cache_layout import CacheLayout
from tilepd.control.sender import KVSender
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig
from tilepd.transport import Buffer
from tilepd.transport.bench import raw_bandwidth

# 16 layers x 2 KV heads x (64 + 64) bf16: 8 KiB per token, 256 MiB at 32K tokens
LAYOUT = CacheLayout(kind="attn", num_layers=16, block_size=128, num_heads=2, entry_width=128, dtype="bfloat16",
                     order="BHNC", head_size_k=64, head_size_v=64)
SIZES = (1024, 8192, 32768)
MAX_SEQ = max(SIZES)


def run(transport: str, repeats: int) -> list[dict]:
    sink = subprocess.Popen([sys.executable, "-m", "tilepd.runtime.sink", "--transport", transport, "--nbytes",
                             str(LAYOUT.buffer_bytes(MAX_SEQ)), "--max-seq-len", str(MAX_SEQ)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        port = json.loads(sink.stdout.readline())["ctrl_port"]
        cfg = ConnectorExtraConfig(decode_allowlist=(DecodeEndpoint(name="sink", host="127.0.0.1", ctrl_port=port, http_port=1),),
                                   transport=TransportConfig(name=transport), model_family="llama", max_seq_len=MAX_SEQ)
        staging = np.random.default_rng(0).integers(0, 256, LAYOUT.buffer_bytes(MAX_SEQ), dtype=np.uint8)
        sender = KVSender(cfg, LAYOUT, Buffer.from_array(staging))
        for tokens in SIZES:
            nb = LAYOUT.blocks_for(tokens)
            src = [l * nb * LAYOUT.block_bytes for l in range(LAYOUT.num_layers)]
            wire, total = [], []
            for i in range(repeats + 1):
                r = sender.send(("127.0.0.1", port), f"bench-{tokens}-{i}", "tok", tokens, nb, src)
                assert r.ok, r
                if i:  # the first is a warm-up
                    wire.append(r.timings["wire_ms"])
                    total.append(r.timings["total_ms"])
            rows.append({"transport": transport, "tokens": tokens, "bytes": r.bytes, "wire_ms": statistics.median(wire),
                         "send_ms": statistics.median(total)})
        sender.close()
    finally:
        sink.stdin.close()
        sink.wait(30)
    raw = raw_bandwidth(transport, rows[-1]["bytes"], repeats=repeats)
    for row in rows:
        row["wire_gbps"] = row["bytes"] / row["wire_ms"] / 1e6
        row["raw_gbps"] = raw["median_gbps"]
        row["wire_vs_raw"] = row["wire_gbps"] / raw["median_gbps"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transports", nargs="+", default=["tcp", "nixl"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [row for t in a.transports for row in run(t, a.repeats)]
    if a.json:
        print(json.dumps(rows))
        return
    print(f"{'transport':9} {'tokens':>6} {'MiB':>6} {'wire ms':>8} {'send ms':>8} {'wire GB/s':>9} {'raw GB/s':>8} {'wire/raw':>8}")
    for r in rows:
        print(f"{r['transport']:9} {r['tokens']:>6} {r['bytes'] / 2**20:>6.0f} {r['wire_ms']:>8.2f} {r['send_ms']:>8.2f} "
              f"{r['wire_gbps']:>9.2f} {r['raw_gbps']:>8.2f} {r['wire_vs_raw']:>8.2f}")


if __name__ == "__main__":
    main()
