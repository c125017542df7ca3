"""The fused attention half-layer's own kernels (tilepd/engine/mla_fused_triton.py) at GLM-5.1's shapes on the GPU.

1. parity at the real shapes: `prepare` (W_UK absorb + q RoPE, the latent's norm + RoPE into the cache, the indexer
   key, the indexer's head weights) and `merge_uv` (split-KV merge + W_UV) against the model's own ops
   (prepare_reference / merge_uv_reference), bf16, T = 1 and 2: max relative error (bf16 rounding order only);
2. time per call inside a CUDA graph (kit.graph_time_us) for each tile configuration of TUNE (--sweep), and the
   bytes each must read (W_UK / W_UV: the floor of the absorb and of the merge), so the defaults can be set from a
   measurement. Exits 1 when an error exceeds --max-rel.

    python bench/mla_fused_gpu.py --out bench/results/mla-fused-gpu_h200.json
    python bench/mla_fused_gpu.py --device cpu --tiny      # CPU smoke test under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import graph_time_us, read_bandwidth
from tilepd.engine import mla_fused_triton as M
from tilepd.engine.rope import rope_table

GLM51 = {"heads": 64, "nope": 192, "rope": 64, "rank": 512, "v": 256, "hidden": 6144, "idx_heads": 32, "idx_d": 128}
TINY = {"heads": 2, "nope": 32, "rope": 16, "rank": 64, "v": 32, "hidden": 96, "idx_heads": 4, "idx_d": 32}
PREPARE_SWEEP = {"block_c": (64, 128), "prep_stages": (1, 3), "prep_warps": (4, 8)}
MERGE_SWEEP = {"block_v": (16, 32, 64), "chunk_c": (128, 256), "merge_stages": (1, 3)}


def inputs(shape: dict, t: int, splits: int, dev: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*size: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=dev) * scale).to(dt)

    h, nope, rope, rank, slots = shape["heads"], shape["nope"], shape["rope"], shape["rank"], 4096
    table = rope_table(rope, 10000.0, None, 8192, slots, dev, dtype, interleaved=True)
    positions = torch.arange(slots - 10 - t, slots - 10, device=dev)
    cs = table.index_select(0, positions)
    return {
        "q": rnd(t, h * (nope + rope)), "kv": rnd(t, rank + rope), "w_uk": rnd(h, nope, rank, scale=0.05), "kv_norm": 1 + rnd(rank, scale=0.1),
        "cs": cs, "positions": positions, "cache": rnd(slots, 1, rank + rope), "kx": rnd(t, shape["idx_d"]),
        "kn": 1 + rnd(shape["idx_d"], scale=0.1), "kb": rnd(shape["idx_d"], scale=0.1), "icache": rnd(slots, shape["idx_d"]),
        "x": rnd(t, shape["hidden"]), "xn": 1 + rnd(shape["hidden"], scale=0.1), "wp": rnd(shape["idx_heads"], shape["hidden"], scale=0.02, dt=torch.float32),
        "part": rnd(t, h, splits, rank, dt=torch.float32), "lse": rnd(t, h, splits, scale=3.0, dt=torch.float32),
        "w_uv": rnd(h, shape["v"], rank, scale=0.05),
    }


def run_prepare(a: dict, shape: dict, weights: bool, cache: torch.Tensor, icache: torch.Tensor, ref: bool = False) -> tuple:
    fn = M.prepare_reference if ref else M.prepare
    index = (a["kx"], a["kn"], a["kb"], a["cs"], icache, True)
    head_weights = (a["x"], a["xn"], 1e-5, a["wp"]) if weights else None
    return fn(a["q"], a["kv"], a["w_uk"], a["kv_norm"], 1e-6, a["cs"], a["positions"], cache, shape["rank"], shape["rope"], True, index, head_weights)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def parity(shape: dict, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    for t in (1, 2):
        a = inputs(shape, t, 16, dev, dtype)
        c1, c2, i1, i2 = a["cache"].clone(), a["cache"].clone(), a["icache"].clone(), a["icache"].clone()
        q1, w1 = run_prepare(a, shape, True, c1, i1)
        q2, w2 = run_prepare(a, shape, True, c2, i2, ref=True)
        m1 = M.merge_uv(a["part"], a["lse"], a["w_uv"], dtype, dtype)
        m2 = M.merge_uv_reference(a["part"], a["lse"], a["w_uv"], dtype, dtype)
        rows.append({"T": t, "q": rel(q1, q2), "cache": rel(c1, c2), "index_cache": rel(i1, i2), "head_weights": rel(w1, w2),
                     "merge_uv": rel(m1, m2)})
    return rows


def sweep(table: dict, base: dict, time_fn) -> list[dict]:  # noqa: ANN001 - a timing closure
    out = []
    keys = list(table)
    for values in itertools.product(*(table[k] for k in keys)):
        cfg = dict(zip(keys, values))
        M.TUNE.update({**base, **cfg})
        try:
            out.append({**cfg, "us": round(time_fn(), 2)})
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot compile or run is reported, the others still run
            out.append({**cfg, "error": repr(e)[:200]})
    M.TUNE.update(base)
    return sorted(out, key=lambda r: r.get("us", float("inf")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-rel", type=float, default=2e-2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    shape = TINY if args.tiny else GLM51
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report: dict = {"shape": shape, "dtype": str(dtype), "tune_default": dict(M.TUNE)}
    if dev.type == "cuda":
        report["gpu"], report["read_GBps"] = torch.cuda.get_device_name(), read_bandwidth(dev, 2.0)["sum_read_GBps"]
    report["parity"] = parity(shape, dev, dtype)
    print(json.dumps({"parity": report["parity"]}), flush=True)
    ok = all(v < args.max_rel for row in report["parity"] for k, v in row.items() if k != "T")
    a = inputs(shape, 1, 16, dev, dtype)
    cache, icache = a["cache"].clone(), a["icache"].clone()
    reps = 20 if dev.type == "cuda" else 1
    base = dict(M.TUNE)
    timers = {
        "prepare (1K: no head weights)": lambda: graph_time_us(lambda: run_prepare(a, shape, False, cache, icache), dev, reps),
        "prepare (past index_topk: with head weights)": lambda: graph_time_us(lambda: run_prepare(a, shape, True, cache, icache), dev, reps),
        "merge_uv (16 splits)": lambda: graph_time_us(lambda: M.merge_uv(a["part"], a["lse"], a["w_uv"], dtype, dtype), dev, reps),
    }
    report["default_us"] = {name: round(fn(), 2) for name, fn in timers.items()}
    gbps = report.get("read_GBps")  # bytes / (GB/s) * 1e-3 = microseconds
    report["floor_us"] = {name: round(w.numel() * w.element_size() / gbps * 1e-3, 2) if gbps else None
                          for name, w in (("W_UK", a["w_uk"]), ("W_UV", a["w_uv"]))}
    print(json.dumps({"default_us": report["default_us"], "floor_us": report["floor_us"]}), flush=True)
    if args.sweep:
        report["prepare_sweep"] = sweep(PREPARE_SWEEP if not args.tiny else {"block_c": (64,), "prep_stages": (1, 2)}, base,
                                        timers["prepare (1K: no head weights)"])
        report["merge_sweep"] = sweep(MERGE_SWEEP if not args.tiny else {"block_v": (16,), "merge_stages": (1, 2)}, base,
                                      timers["merge_uv (16 splits)"])
        print(json.dumps({"prepare_best": report["prepare_sweep"][:3], "merge_best": report["merge_sweep"][:3]}), flush=True)
    if args.sweep:  # the best tiles as the env overrides tilepd reads, for a run after this one
        best = {**report["prepare_sweep"][0], **report["merge_sweep"][0]}
        report["best_env"] = " ".join(f"TILEPD_MLA_FUSED_{k.upper()}={v}" for k, v in best.items() if k in M.TUNE)
        print("best_env", report["best_env"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("mla fused gpu " + ("ok" if ok else "FAIL: an error above --max-rel"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
