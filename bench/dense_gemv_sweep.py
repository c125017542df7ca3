"""Sweep the dense GEMV kernel's tiles on the real device for Llama-3-8B's four per-layer GEMVs, each with its fusion.

The fused dense GEMV (tilepd/engine/gemv_triton.py: norm / SiLU-mul before, residual add after) replaces a Llama
layer's cuBLAS or Inductor GEMVs and the small kernels around them. This times, per shape (one CUDA graph over enough
distinct weight copies to exceed L2, time divided by the copies), every block_n x block_k x num_warps config, beside
cuBLAS (F.linear alone, no fusion) and the kernel's current rule (gemv_triton.tile), and prints each shape's best config and
bandwidth and the one config whose summed time over the shapes is least (the candidate default). Each config's
output is checked against the unfused ops first.

    python bench/dense_gemv_sweep.py --out bench/results/dense-gemv-sweep_h200_<date>.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import graph_replay_ms
from sweep_check import config_ok, tune_override
from tilepd.engine import gemv_triton

# (name, N, K, prologue, residual): Llama-3-8B's batch-1 GEMVs with what the speed path fuses into each
SHAPES = [("qkv", 6144, 4096, "norm", False), ("o", 4096, 4096, "none", True), ("gate_up", 28672, 4096, "norm", False),
          ("down", 4096, 14336, "silu_mul", True)]
L2_BYTES = 256 << 20


def configs() -> list[dict[str, int]]:
    return [{"block_n": bn, "block_k": bk, "num_warps": w}
            for bn, bk, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev, dt = torch.device("cuda:0"), torch.bfloat16
    default = dict(gemv_triton.TUNE)
    g = torch.Generator(device=dev).manual_seed(0)
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "default": default, "shapes": []}
    summed: dict[str, float] = {}
    counted: dict[str, int] = {}

    def timed(cfg: dict[str, int], ws, x, nw, res, prologue) -> float:
        with tune_override(gemv_triton.TUNE, cfg):
            return graph_replay_ms(lambda: [gemv_triton.launch(x, w, nw, 1e-5, prologue, res) for w in ws], 20, batches=3) / len(ws)

    for name, n, k, prologue, with_res in SHAPES:
        copies = max(2, -(-L2_BYTES // (2 * n * k)))
        ws = [torch.randn(n, k, device=dev, generator=g, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, 2 * k if prologue == "silu_mul" else k, device=dev, dtype=dt, generator=g)
        nw = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt) if prologue == "norm" else None
        res = torch.randn(1, n, device=dev, dtype=dt, generator=g) if with_res else None
        ref = gemv_triton.reference(x.float(), ws[0].float(), None if nw is None else nw.float(), 1e-5, prologue,
                                    None if res is None else res.float())
        xin = x[:, :k] if prologue == "silu_mul" else x
        ms_cublas = graph_replay_ms(lambda: [torch.nn.functional.linear(xin, w) for w in ws], 20, batches=3) / len(ws)
        rows = []
        for cfg in configs():
            key = json.dumps(cfg, sort_keys=True)
            if not config_ok(gemv_triton.TUNE, cfg, lambda: gemv_triton.launch(x, ws[0], nw, 1e-5, prologue, res), ref, f"{name} {key}", 2e-2):
                continue
            ms = timed(cfg, ws, x, nw, res, prologue)
            rows.append((ms, cfg))
            summed[key] = summed.get(key, 0.0) + ms
            counted[key] = counted.get(key, 0) + 1
        rows.sort(key=lambda r: r[0])
        ms_default = timed({}, ws, x, nw, res, prologue)
        nbytes = 2 * n * k
        entry = {"name": name, "n": n, "k": k, "prologue": prologue, "residual": with_res, "copies": copies,
                 "cublas_us": ms_cublas * 1e3, "cublas_gbs": nbytes / ms_cublas / 1e6,
                 "default_us": ms_default * 1e3, "default_gbs": nbytes / ms_default / 1e6,
                 "best_us": rows[0][0] * 1e3, "best_gbs": nbytes / rows[0][0] / 1e6, "best": rows[0][1],
                 "top5": [{"us": ms * 1e3, "cfg": c} for ms, c in rows[:5]]}
        report["shapes"].append(entry)
        print(f"{name:8s} [{n}x{k}] cuBLAS {entry['cublas_us']:6.1f} us ({entry['cublas_gbs']:5.0f} GB/s)  fused default "
              f"{entry['default_us']:6.1f} us ({entry['default_gbs']:5.0f} GB/s)  best {entry['best_us']:6.1f} us "
              f"({entry['best_gbs']:5.0f} GB/s) {rows[0][1]}  next {[(round(ms * 1e3, 1), c) for ms, c in rows[1:4]]}", flush=True)
        del ws
        torch.cuda.empty_cache()
    complete = {kk: v for kk, v in summed.items() if counted[kk] == len(report["shapes"])}
    overall = sorted(complete.items(), key=lambda kv: kv[1])[:5]
    report["overall_top5"] = [{"cfg": json.loads(kk), "sum_us": v * 1e3} for kk, v in overall]
    report["default_sum_us"] = sum(e["default_us"] for e in report["shapes"])
    report["best_per_shape_sum_us"] = sum(e["best_us"] for e in report["shapes"])
    report["cublas_sum_us"] = sum(e["cublas_us"] for e in report["shapes"])
    print(f"summed: cuBLAS (no fusion) {report['cublas_sum_us']:.1f} us, fused default {report['default_sum_us']:.1f} us, "
          f"each shape's best {report['best_per_shape_sum_us']:.1f} us", flush=True)
    for kk, v in overall:
        print(f"one config for all shapes: {kk}: {v * 1e3:.1f} us summed", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
