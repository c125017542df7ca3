"""Raw transport bandwidth between two processes, and the checksum check the tests use.

`raw_bandwidth(name, nbytes)` starts a receiver process (`python -m
tilepd.transport.bench serve`), registers `nbytes` of random data here, writes it
as one descriptor `repeats` times and returns the rates plus whether the bytes
that landed match (sha256 computed by the receiver). `bench/handoff.py` calls it
to print the wire time of a KV handoff beside the transport's raw rate::

    from tilepd.transport.bench import raw_bandwidth
    r = raw_bandwidth("nixl", 256 << 20)   # {"transport", "nbytes", "best_gbps", "median_gbps", "runs_s", "checksum_ok"}

The receiver process speaks a line protocol on stdin/stdout: it prints its
`describe()` as one JSON line, then answers `arm GEN` with `armed` and
`check GEN NBYTES` with `{"landed": bool, "sha256": hex}`.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from tilepd.contracts.service_configs import TransportConfig
from tilepd.transport.base import Buffer, Segment
from tilepd.transport.registry import make_receiver, make_sender


class ReceiverProcess:
    """A receiver in its own process (real sockets / real NIXL agents between two processes)."""

    def __init__(self, name: str, nbytes: int, python: str | None = None, protocol: str = "rdma"):
        argv = [python or sys.executable, "-m", "tilepd.transport.bench", "serve", "--transport", name, "--nbytes", str(nbytes),
                "--mooncake-protocol", protocol]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"receiver process for {name} exited with {self.proc.returncode} before describing itself")
        self.metadata: dict[str, Any] = json.loads(line)

    def _ask(self, line: str) -> str:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def arm(self, generation: int) -> None:
        assert self._ask(f"arm {generation}") == "armed"

    def check(self, generation: int, nbytes: int) -> dict[str, Any]:
        return json.loads(self._ask(f"check {generation} {nbytes}"))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask("quit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def raw_bandwidth(name: str, nbytes: int, repeats: int = 3, warmup: int = 1, protocol: str = "rdma") -> dict[str, Any]:
    """Bytes/s of one `nbytes` write between this process and a receiver process (GB/s = 1e9 B/s).

    `protocol` is mooncake's ("rdma" or "tcp"); the other transports ignore it.
    """
    cfg = TransportConfig(name=name, mooncake_protocol=protocol)  # type: ignore[arg-type]
    data = np.random.default_rng(0).integers(0, 256, size=nbytes, dtype=np.uint8)
    rx = ReceiverProcess(name, nbytes, protocol=protocol)
    sender = make_sender(cfg, name="tilepd-bench")
    try:
        sender.register(Buffer.from_array(data))
        peer = sender.connect(rx.metadata)
        runs: list[float] = []
        gen = 1
        for i in range(warmup + repeats):
            gen += 1
            rx.arm(gen)
            t = time.perf_counter()
            sender.write(peer, [Segment(0, 0, nbytes)], generation=gen, transfer_id="bench").wait(120)
            dt = time.perf_counter() - t
            if i >= warmup:
                runs.append(dt)
        check = rx.check(gen, nbytes)
        ok = bool(check["landed"]) and check["sha256"] == hashlib.sha256(data.tobytes()).hexdigest()
    finally:
        sender.close()
        rx.close()
    return {"transport": name, "nbytes": nbytes, "runs_s": runs, "best_gbps": nbytes / min(runs) / 1e9,
            "median_gbps": nbytes / statistics.median(runs) / 1e9, "checksum_ok": ok}


def _serve(name: str, nbytes: int, protocol: str) -> int:
    cfg = TransportConfig(name=name, mooncake_protocol=protocol)  # type: ignore[arg-type]
    # the protocol owns stdout: anything a library prints (NIXL logs) goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    buf = np.zeros(nbytes, dtype=np.uint8)
    rx = make_receiver(cfg, bind_host="127.0.0.1", advertise_host="127.0.0.1", name="tilepd-bench-rx")
    rx.register(Buffer.from_array(buf))
    print(json.dumps(rx.describe()), file=out, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "arm":
            rx.arm(int(cmd[1]), "bench", nbytes)
            print("armed", file=out, flush=True)
        elif cmd[0] == "check":
            gen, n = int(cmd[1]), int(cmd[2])
            landed = rx.wait_received(gen, n, 30.0, key="bench")
            print(json.dumps({"landed": landed, "sha256": hashlib.sha256(buf[:n].tobytes()).hexdigest()}), file=out, flush=True)
    rx.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tilepd.transport.bench", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run a receiver (used by raw_bandwidth)")
    s.add_argument("--transport", required=True)
    s.add_argument("--nbytes", type=int, required=True)
    s.add_argument("--mooncake-protocol", default="rdma")
    r = sub.add_parser("run", help="measure raw bandwidth")
    r.add_argument("--transport", default="tcp")
    r.add_argument("--mib", type=int, default=256)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--mooncake-protocol", default="rdma")
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        return _serve(a.transport, a.nbytes, a.mooncake_protocol)
    print(json.dumps(raw_bandwidth(a.transport, a.mib << 20, a.repeats, protocol=a.mooncake_protocol)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    raise SystemExit(main())
