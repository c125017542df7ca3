"""Dense MLA attention over long windows (DeepSeek-V3's 128 heads, no DSA): the split kernel's tiles for TUNE_LONG.

Why: at 32K the DeepSeek-V3 step's split kernel took 63.6 us a layer on an H100 (2026-12-06) for 38 MB of cache rows
(~12.6 us of bytes): with 128 heads sharing every row the attention is ~9 GFLOPs a layer, and TUNE's 32-head programs
(picked at 1K-4K, where the kernel is latency-bound) run their dots as mma.sync from registers and spill. This times the
split kernel + merge_uv (as the step runs them, caches rotated past the L2) per tile and split policy at 4K-128K,
checks each tile's output against the float32 reference (dsa.sparse_mla_attention + W_UV) at 32K first, and picks
TUNE_LONG: the tile with the least geometric-mean time over the long windows (32K, 128K), used from the shortest
window at and past which it beats TUNE at every measured length.

    python bench/mla_dense_long.py --out bench/results/mla-dense-long_h100.json --best-env /tmp/long.env
    python bench/mla_dense_long.py --device cpu --tiny     # CPU smoke test under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import read_bandwidth
from sweep_check import tune_override
from mla_fused_gpu import DSV3, TILE_KEYS, TINY, attention, attention_case, attention_reference, cache_copies, rel, split_tiles, time_attention
from tilepd.engine import mla_attention as A

# (block_h, block_n, num_warps, num_stages): TUNE's tile, then 64-head programs of 8 warps (wgmma on sm_90; ptxas with
# Triton 3.9: 36-88 B of spill at 64-row blocks, 8 B at 32), and 32-head tiles of 8 warps (mma.sync without spill)
TILES = [(32, 64, 4, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 32, 8, 1), (64, 64, 8, 1), (64, 64, 8, 2), (64, 16, 8, 2), (64, 16, 8, 3),
         (32, 32, 8, 2), (32, 64, 8, 2)]
POLICIES = [(132, 1), (264, 1)]  # (programs aimed for, min_blocks)
WINDOWS = (4096, 8192, 32768, 131072)
LONG = (32768, 131072)  # the windows the pick is made on
TINY_TILES, TINY_POLICIES, TINY_WINDOWS, TINY_LONG = [(16, 16, 4, 1), (16, 32, 4, 1)], [(4, 1)], (64, 256), (256,)


def tile_name(cfg: dict) -> str:
    return "/".join(str(cfg[k]) for k in TILE_KEYS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--max-rel", type=float, default=2e-2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--best-env", type=Path, help="write the picked TUNE_LONG as shell exports (TILEPD_MLA_LONG_*)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    shape = {**TINY, "idx_heads": 0, "idx_d": 0, "topk": 0} if args.tiny else DSV3  # dense: no indexer
    tiles, policies, windows, long = (TINY_TILES, TINY_POLICIES, TINY_WINDOWS, TINY_LONG) if args.tiny else (TILES, POLICIES, WINDOWS, LONG)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report: dict = {"shape": shape, "dtype": str(dtype), "tune": dict(A.TUNE), "tune_long_default": dict(A.TUNE_LONG)}
    if dev.type == "cuda":
        report["gpu"], report["read_GBps"] = torch.cuda.get_device_name(), read_bandwidth(dev, 2.0)["sum_read_GBps"]
    row_bytes = (shape["rank"] + shape["rope"]) * torch.finfo(dtype).bits // 8
    cases = {w: attention_case(shape, 1, w, w, "dense", dev, dtype, cache_copies(w, row_bytes, dev, 64)) for w in windows}
    if report.get("read_GBps"):
        report["rows_floor_us"] = {w: round(w * row_bytes / report["read_GBps"] * 1e-3, 2) for w in windows}
    reps = args.reps if dev.type == "cuda" else 1
    check = long[0]
    ref = attention_reference(cases[check], shape)
    rows = []
    base = {k: A.TUNE[k] for k in TILE_KEYS}  # TUNE's own tile first: the baseline every pick is measured against
    combos = [base] + [c for c in split_tiles(tiles, policies) if c != base]
    for cfg in combos:
        row: dict = {"tile": tile_name(cfg), **cfg}
        with tune_override(A.TUNE_LONG, {**cfg, "from": 0}):  # every window of this bench takes the tile
            try:
                c = cases[check]
                out = attention(c["q"], c["caches"][0], shape, c["w_uv"], c["length"], None, c["span"])
                row["rel_err"] = rel(out.float(), ref)
                for w in windows:
                    row[str(w)] = round(time_attention(cases[w], shape, dev, reps), 2)
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                row["error"] = repr(e)[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["rows"] = rows
    ok_rows = [r for r in rows if "error" not in r and r["rel_err"] < args.max_rel]
    bad = [r["tile"] for r in rows if "error" in r or r["rel_err"] >= args.max_rel]
    report["failed_tiles"] = bad
    baseline = next((r for r in ok_rows if all(r[k] == base[k] for k in TILE_KEYS)), None)
    if ok_rows and baseline:
        best = min(ok_rows, key=lambda r: math.fsum(math.log(r[str(w)]) for w in long))
        start = None
        for w in sorted(windows, reverse=True):  # the shortest window from which the pick wins at every longer one
            if best[str(w)] < baseline[str(w)]:
                start = w
            else:
                break
        report["baseline"], report["best"], report["from"] = baseline, best, start
        report["speedup"] = {w: round(baseline[str(w)] / best[str(w)], 3) for w in windows}
        print(json.dumps({"baseline": baseline["tile"], "best": best["tile"], "from": start, "speedup": report["speedup"]}), flush=True)
        if args.best_env and start is not None:
            env = {f"TILEPD_MLA_LONG_{k.upper()}": best[k] for k in TILE_KEYS} | {"TILEPD_MLA_LONG_FROM": start}
            args.best_env.write_text("".join(f"export {k}={v}\n" for k, v in env.items()))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if bad:
        print(f"tiles over --max-rel {args.max_rel} or failing: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
