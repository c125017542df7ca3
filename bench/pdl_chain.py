"""What a launch costs inside a CUDA graph, with and without programmatic dependent launch (PDL), on this GPU.

The decode step is a chain of small dependent kernels replayed from a CUDA graph; between two of them the GPU sits
idle for the launch of the next (~1.5-2 us a launch on an H200 in the profiles, docs/PERFORMANCE.md). PDL lets the
next kernel's programs be scheduled while the previous one finishes: the next one waits (`gdc_wait`) before it
reads what the previous one wrote. This bench times a chain of N dependent Triton kernels, each reading the last
one's output (a few KB, as a norm or a merge does), captured in one CUDA graph, in three forms:

  plain   no PDL;
  pdl     launched with launch_pdl=True, gdc_wait first, gdc_launch_dependents after the stores;
  early   the same, gdc_launch_dependents right after the wait (the next kernel's programs may start sooner).

It checks the chain's result (every form must compute the same values) and prints us per launch.

    python bench/pdl_chain.py --out bench/results/pdl-chain_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _step(X, Y, N, MODE: tl.constexpr, BLOCK: tl.constexpr):
    if MODE > 0:
        gdc_wait()
        if MODE == 2:
            gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m, other=0.0)
    tl.store(Y + offs, x * 0.5 + 1.0, mask=m)
    if MODE == 1:
        gdc_launch_dependents()


def chain(bufs: list[torch.Tensor], n: int, mode: int, block: int) -> None:
    size = bufs[0].numel()
    grid = (triton.cdiv(size, block),)
    for i in range(n):
        extra = {"launch_pdl": True} if mode > 0 else {}
        _step[grid](bufs[i % 2], bufs[(i + 1) % 2], size, MODE=mode, BLOCK=block, num_warps=4, **extra)


def time_form(mode: int, n: int, size: int, block: int, reps: int) -> tuple[float, float]:
    bufs = [torch.zeros(size, device="cuda"), torch.zeros(size, device="cuda")]
    chain(bufs, n, mode, block)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(bufs, n, mode, block)
    bufs[0].fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    result = float(bufs[n % 2][0])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / n, result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    for size, block in ((1024, 1024), (132 * 1024, 1024), (1024 * 1024, 1024)):
        row: dict = {"elements": size, "programs": triton.cdiv(size, block)}
        for name, mode in (("plain", 0), ("pdl", 1), ("early", 2)):
            try:
                us, value = time_form(mode, args.launches, size, block, args.reps)
                row[name] = {"us_per_launch": round(us, 3), "value": value}
            except Exception as e:  # noqa: BLE001 - a form this Triton/driver cannot launch is reported, the others still run
                row[name] = {"error": repr(e)[:300]}
        values = {r["value"] for r in row.values() if isinstance(r, dict) and "value" in r}
        row["same_result"] = len(values) <= 1
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
