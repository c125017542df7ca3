"""Sweep the fp8 GEMV kernel's variants on the real device: which tile, conversion and pipelining read fastest.

The fp8 block-scaled GEMV (tilepd/engine/fp8_triton.py) read at ~60% of the bf16 cuBLAS GEMV's bandwidth on
one H200 (docs/PERFORMANCE.md), which keeps dsv3-small fp8 under issue 12's 70% at 32K. This times, for the
batch-1 GEMV shapes of Llama-3-8B and DeepSeek-V3 (one CUDA graph over enough distinct weight copies to
exceed L2, time divided by the copies), every config of the kernel's TUNE knobs:

- block_n x block_k x num_warps (block_k >= 1024 reduces each chunk: a full tile accumulator would spill),
- bits_cvt: e4m3 -> fp16 by two integer ops instead of the convert instruction,
- num_stages: Triton's software pipelining of the chunk loads (second pass, on each shape's best config),

beside the same shape in bf16 (cuBLAS) and the current default, and prints per shape the best config and its
bandwidth, then the one config whose summed time over all shapes is least (the candidate default). Checks
each timed config's output against dequantise-then-matmul first.

    python bench/fp8_gemv_sweep.py --json --out bench/results/fp8-gemv-sweep_h200_<date>.json
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
from tilepd.engine import fp8_triton
from tilepd.model_format.block_fp8 import dequantize, quantize

# (name, N, K): batch-1 GEMVs of one layer
SHAPES = [
    ("llama8b.qkv", 6144, 4096), ("llama8b.o", 4096, 4096), ("llama8b.gate_up", 28672, 4096), ("llama8b.down", 4096, 14336),
    ("dsv3.q_a+kv_a", 2112, 7168), ("dsv3.q_b", 24576, 1536), ("dsv3.o", 7168, 16384),
    ("dsv3.shared_gate_up", 4096, 7168), ("dsv3.shared_down", 7168, 2048), ("dsv3.dense_gate_up", 36864, 7168),
]
# (name, N, K, prologue/epilogue): GLM-5.1's and DeepSeek-V3's attention GEMVs as the fused step launches them
# (mla_fused.py's G1 with the norm in its prologue, G2 the same, wo with the residual add), for --fused
FUSED_SHAPES = [("glm51.G1 q_a|idx_wk|kv_a", 2752, 6144, "norm"), ("glm51.G2 q_b", 16384, 2048, "norm"), ("glm51.wo", 6144, 16384, "res"),
                ("dsv3.G1 q_a|kv_a", 2112, 7168, "norm"), ("dsv3.G2 q_b", 24576, 1536, "norm"), ("dsv3.wo", 7168, 16384, "res")]
L2_BYTES = 256 << 20  # distinct weight bytes per timed graph: well past the H200's 50 MB L2


def graph_ms(fn, iters: int = 20) -> float:
    return graph_replay_ms(fn, iters, batches=3)


def configs_first_pass() -> list[dict[str, int]]:
    out = []
    for bits, bn, bk, warps in itertools.product((0, 1), (8, 16), (512, 1024, 2048), (4, 8)):
        out.append({"bits_cvt": bits, "block_n": bn, "block_k": bk, "num_warps": warps, "reduce_each": int(bk >= 1024),
                    "num_stages": 0})
    out += [{"bits_cvt": b, "block_n": 8, "block_k": 256, "num_warps": 2, "reduce_each": 0, "num_stages": 0} for b in (0, 1)]
    return out


def fused_configs() -> list[dict[str, int]]:
    """The tiles --fused tries: fewer output rows a program than the plain sweep (G1's 2752 rows make only 344
    programs of 8), each chunk width (block_k_norm too: the norm-prologue launches' chunk), 4 or 8 warps; block_n 0 is
    the picked tile."""
    return [{"block_n": bn, "block_k": bk, "block_k_norm": bk, "num_warps": warps, "reduce_each": int(bk >= 1024)}
            for bn, bk, warps in itertools.product((0, 2, 4, 16), (512, 1024, 2048), (4, 8))]


def fused_sweep(dev: torch.device) -> dict:
    """Each fused shape (norm prologue or residual epilogue, as the step launches it) at each tile of fused_configs(),
    side by side in one process (distinct weight copies past L2, as above); each config's output checked against
    rms_norm + dequantise-then-matmul (+ residual) first."""
    default = dict(fp8_triton.TUNE)
    g = torch.Generator(device=dev).manual_seed(0)
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "default": default, "shapes": []}
    print(f"device {report['device']}, torch {torch.__version__}, default TUNE {default}", flush=True)
    configs = fused_configs()
    summed: dict[str, float] = {}
    for name, n, k, kind in FUSED_SHAPES:
        copies = max(2, -(-L2_BYTES // (n * k)))
        w0 = torch.randn(n, k, device=dev, generator=g) * 0.02
        ws = [quantize(w0 * (1 + 0.01 * i)) for i in range(copies)]
        del w0
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        nw = torch.rand(k, device=dev, generator=g).to(torch.bfloat16) + 0.5
        res = torch.randn(1, n, device=dev, dtype=torch.bfloat16, generator=g)
        extra = {"norm_weight": nw, "eps": 1e-6} if kind == "norm" else {"residual": res}
        xin = torch.nn.functional.rms_norm(x.float(), (k,), nw.float(), 1e-6) if kind == "norm" else x.float()
        ref = xin @ dequantize(ws[0]).T + (0 if kind == "norm" else res.float())

        def run(w):
            return fp8_triton.launch_fused(x, w.weight, w.scale, w.block, **extra)

        times = {}
        for cfg in configs:
            key = json.dumps(cfg, sort_keys=True)
            if not config_ok(fp8_triton.TUNE, cfg, lambda: run(ws[0]), ref, f"{name} {key}", 2e-2):
                continue
            with tune_override(fp8_triton.TUNE, cfg):
                times[key] = graph_ms(lambda: [run(w) for w in ws]) / len(ws)
            summed[key] = summed.get(key, 0.0) + times[key]
        nbytes = ws[0].nbytes()
        ranked = sorted(times.items(), key=lambda kv: kv[1])
        dflt = graph_ms(lambda: [run(w) for w in ws]) / len(ws)  # TUNE as the engine has it
        entry = {"name": name, "n": n, "k": k, "kind": kind, "copies": copies, "default_us": dflt * 1e3,
                 "top5": [{"us": t * 1e3, "gbs": nbytes / t / 1e6, "cfg": json.loads(kk)} for kk, t in ranked[:5]]}
        report["shapes"].append(entry)
        best_ms = ranked[0][1]
        print(f"{name:26s} [{n}x{k}] {kind:4s} default {dflt * 1e3:6.1f} us ({nbytes / dflt / 1e6:5.0f} GB/s)  best {best_ms * 1e3:6.1f} us ({nbytes / best_ms / 1e6:5.0f} GB/s) "
              f"{ranked[0][0]}", flush=True)
        for kk, t in ranked[1:4]:
            print(f"{'':26s}   next {t * 1e3:6.1f} us {kk}", flush=True)
        del ws
        torch.cuda.empty_cache()
    complete = sorted((v, kk) for kk, v in summed.items())
    report["summed_us"] = {kk: v * 1e3 for v, kk in complete}
    for v, kk in complete[:5]:
        print(f"one config for all fused shapes: {kk}: {v * 1e3:.1f} us summed", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", nargs="*", help="names from SHAPES (default all)")
    ap.add_argument("--fused", action="store_true", help="instead: FUSED_SHAPES launched as the fused step launches them "
                    "(launch_fused), at each tile of fused_configs()")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    if args.fused:
        report = fused_sweep(torch.device("cuda:0"))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))
        return
    dev = torch.device("cuda:0")
    default = dict(fp8_triton.TUNE)
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, default TUNE {default}", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    first = configs_first_pass()
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "default": default, "shapes": []}
    summed: dict[str, float] = {}
    counted: dict[str, int] = {}

    def timed(cfg: dict[str, int], ws, x) -> float:
        with tune_override(fp8_triton.TUNE, cfg):
            return graph_ms(lambda: [fp8_triton.launch(x, w.weight, w.scale, None, None, 128, 128) for w in ws]) / len(ws)

    for name, n, k in shapes:
        copies = max(2, -(-L2_BYTES // (n * k)))
        w0 = torch.randn(n, k, device=dev, generator=g) * 0.02
        ws = [quantize(w0 * (1 + 0.01 * i)) for i in range(copies)]
        dense = [(w0 * (1 + 0.01 * i)).to(torch.bfloat16) for i in range(min(copies, max(2, -(-L2_BYTES // (2 * n * k)))))]
        del w0
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
        ref = x.float() @ dequantize(ws[0]).T
        ms_bf16 = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in dense]) / len(dense)
        rows = []
        for cfg in first:
            key = json.dumps(cfg, sort_keys=True)
            if not config_ok(fp8_triton.TUNE, cfg, lambda: fp8_triton.launch(x, ws[0].weight, ws[0].scale, None, None, 128, 128), ref,
                             f"{name} {key}", 1e-2):
                continue
            ms = timed(cfg, ws, x)
            rows.append((ms, cfg))
            summed[key] = summed.get(key, 0.0) + ms
            counted[key] = counted.get(key, 0) + 1
        rows.sort(key=lambda r: r[0])
        best_ms, best_cfg = rows[0]
        for stages in (2, 3, 4):  # second pass: pipelining on this shape's best config
            cfg = {**best_cfg, "num_stages": stages}
            try:
                ms = timed(cfg, ws, x)
            except Exception as e:  # noqa: BLE001
                print(f"  [{name}] stages {stages}: {type(e).__name__}", flush=True)
                continue
            if ms < best_ms:
                best_ms, best_cfg = ms, cfg
        ms_default = timed({}, ws, x)
        nbytes = ws[0].nbytes()
        entry = {"name": name, "n": n, "k": k, "copies": copies, "bf16_us": ms_bf16 * 1e3, "bf16_gbs": 2 * n * k / ms_bf16 / 1e6,
                 "default_us": ms_default * 1e3, "default_gbs": nbytes / ms_default / 1e6,
                 "best_us": best_ms * 1e3, "best_gbs": nbytes / best_ms / 1e6, "best": best_cfg,
                 "top5": [{"us": ms * 1e3, "cfg": c} for ms, c in rows[:5]]}
        report["shapes"].append(entry)
        print(f"{name:22s} [{n}x{k}] bf16 {entry['bf16_us']:7.1f} us ({entry['bf16_gbs']:5.0f} GB/s)  fp8 default "
              f"{entry['default_us']:7.1f} us ({entry['default_gbs']:5.0f} GB/s)  best {entry['best_us']:7.1f} us "
              f"({entry['best_gbs']:5.0f} GB/s) {best_cfg}", flush=True)
        del ws, dense
        torch.cuda.empty_cache()
    if summed:
        complete = {kk: v for kk, v in summed.items() if counted[kk] == len(report["shapes"])}  # timed on every shape
        overall = sorted(complete.items(), key=lambda kv: kv[1])[:5]
        default_sum = sum(e["default_us"] for e in report["shapes"])
        report["overall_top5"] = [{"cfg": json.loads(kk), "sum_us": v * 1e3} for kk, v in overall]
        report["default_sum_us"] = default_sum
        report["best_per_shape_sum_us"] = sum(e["best_us"] for e in report["shapes"])
        print(f"summed over the shapes: default {default_sum:.1f} us, each shape's best {report['best_per_shape_sum_us']:.1f} us", flush=True)
        for kk, v in overall:
            print(f"one config for all shapes: {kk}: {v * 1e3:.1f} us summed", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
