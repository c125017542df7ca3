"""The fused MoE router and the grouped MoE layer on the GPU: exactness against the torch reference, time per layer.

    python bench/moe_route_gpu.py --out moe_route_gpu.json          # one H200: DeepSeek-V3 and GLM-5.1 shapes
    TRITON_INTERPRET=1 python bench/moe_route_gpu.py --device cpu --tiny   # the same code on tiny shapes

1. route_triton.route_logits (via moe.route with ROUTE_IMPL "triton") against moe.route_torch on random gate
   weights, biases and bf16 activations, T = 1, 2, 4 (MTP verify rows), DeepSeek-V3 (8 groups, best 4) and GLM-5.1
   (1 group): the same expert sets and weights to float32 rounding; mismatches are counted and printed.
2. moe.moe() in its grouped form (moe_grouped: router kernel, shared expert as one more row of each grouped GEMV,
   one bmm for the weighted sum) against the speed path's previous form (torch router, routed experts' GEMV, shared
   expert apart), bf16 and fp8 experts, GLM-5.1 shapes: max abs difference over the output's max abs.
3. Each form's time inside a CUDA graph (us per call, no launch overhead): the router alone, the whole MoE layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import graph_time_us
from tilepd.engine import moe
from tilepd.model_format.block_fp8 import BlockFp8, quantize

ROUTERS = {"deepseek-v3": dict(h=7168, e=256, n_group=8, topk_group=4, k=8), "glm-5.1": dict(h=6144, e=256, n_group=1, topk_group=1, k=8)}
TINY = {"deepseek-v3": dict(h=32, e=16, n_group=4, topk_group=2, k=3), "glm-5.1": dict(h=32, e=16, n_group=1, topk_group=1, k=3)}


def _spec(c: dict) -> SimpleNamespace:
    return SimpleNamespace(n_group=c["n_group"], topk_group=c["topk_group"], num_experts_per_tok=c["k"], norm_topk_prob=True,
                           routed_scaling_factor=2.5)


def check_router(dev: torch.device, dtype: torch.dtype, shapes: dict, trials: int) -> list[dict]:
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, c in shapes.items():
        spec = _spec(c)
        for t in (1, 2, 4):
            bad = 0
            worst = 0.0
            for _ in range(trials):
                gate = torch.randn(c["e"], c["h"], generator=g, device=dev) * c["h"] ** -0.5
                bias = torch.randn(c["e"], generator=g, device=dev) * 0.1
                x = torch.randn(t, c["h"], generator=g, device=dev).to(dtype)
                moe.ROUTE_IMPL["router"] = "triton"
                ids, w = moe.route(x, gate, bias, spec)
                moe.ROUTE_IMPL["router"] = "torch"
                rid, rw = moe.route_torch(x, gate, bias, spec)
                a, ia = rid.sort(-1)
                b, ib = ids.sort(-1)
                if not torch.equal(a, b):
                    bad += 1
                    print(f"  router mismatch {name} T={t}: kernel {ids.tolist()} reference {rid.tolist()}", flush=True)
                    continue
                worst = max(worst, float((w.gather(1, ib) - rw.gather(1, ia)).abs().max()))
            gate = torch.randn(c["e"], c["h"], generator=g, device=dev) * c["h"] ** -0.5
            bias = torch.randn(c["e"], generator=g, device=dev) * 0.1
            x = torch.randn(t, c["h"], generator=g, device=dev).to(dtype)

            def kernel() -> None:
                moe.ROUTE_IMPL["router"] = "triton"
                moe.route(x, gate, bias, spec)

            def reference() -> None:
                moe.route_torch(x, gate, bias, spec)

            us_k, us_r = graph_time_us(kernel, dev), graph_time_us(reference, dev)
            moe.ROUTE_IMPL["router"] = "torch"
            row = {"case": f"router {name} T={t}", "trials": trials, "id_mismatches": bad, "max_weight_diff": worst,
                   "kernel_us": us_k, "torch_us": us_r}
            rows.append(row)
            print(row, flush=True)
    return rows


def _stack_fp8(w: torch.Tensor) -> BlockFp8:
    parts = [quantize(w[e]) for e in range(w.shape[0])]
    return BlockFp8(torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts]), parts[0].block)


def check_layer(dev: torch.device, dtype: torch.dtype, tiny: bool) -> list[dict]:
    """GLM-5.1's MoE layer (256 experts of 2048, 1 shared, top-8) both ways, bf16 and fp8 experts."""
    h, mi, e, k = (32, 16, 16, 3) if tiny else (6144, 2048, 256, 8)
    c = {"n_group": 1, "topk_group": 1, "k": k}
    spec = _spec(c)
    g = torch.Generator(device=dev).manual_seed(1)
    base = {"l.gate": torch.randn(e, h, generator=g, device=dev) * h ** -0.5, "l.gate_bias": torch.randn(e, generator=g, device=dev) * 0.1,
            "l.experts_w13": (torch.randn(e, 2 * mi, h, generator=g, device=dev, dtype=dtype) * h ** -0.5),
            "l.experts_w2": (torch.randn(e, h, mi, generator=g, device=dev, dtype=dtype) * mi ** -0.5),
            "l.shared_w13": (torch.randn(2 * mi, h, generator=g, device=dev, dtype=dtype) * h ** -0.5),
            "l.shared_w2": (torch.randn(h, mi, generator=g, device=dev, dtype=dtype) * mi ** -0.5)}
    rows = []
    for fmt in ("bf16", "fp8"):
        if fmt == "fp8":
            if dev.type != "cuda":
                continue  # the fp8 expert kernel runs on CUDA only through moe(); its CPU check is tests/engine/test_moe_triton.py
            w = dict(base)
            for name in ("l.experts_w13", "l.experts_w2"):
                w[name] = _stack_fp8(base[name])
            for name in ("l.shared_w13", "l.shared_w2"):
                w[name] = quantize(base[name])
        else:
            w = base
        for t in (1, 2):
            x = torch.randn(t, h, generator=g, device=dev).to(dtype)

            def grouped() -> torch.Tensor:
                moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "triton", "triton"
                return moe.moe(x, w, "l.", spec)

            def previous() -> torch.Tensor:
                moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "triton", "torch"
                return moe.moe(x, w, "l.", spec)

            moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "triton", "triton"
            assert moe._grouped_shared(x, w, "l.", spec), "the grouped form must apply here"
            a, b = grouped().float(), previous().float()
            row = {"case": f"moe layer glm-5.1 {fmt} T={t}", "rel_max_diff": float((a - b).abs().max() / b.abs().max()),
                   "grouped_us": graph_time_us(grouped, dev), "previous_us": graph_time_us(previous, dev)}
            moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "gather", "torch"
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--trials", type=int, default=None, help="random cases per router shape and T (default 200; tiny 5)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "rows": check_router(dev, dtype, TINY if args.tiny else ROUTERS, args.trials or (5 if args.tiny else 200))}
    report["rows"] += check_layer(dev, dtype, args.tiny)
    bad = [r for r in report["rows"] if r.get("id_mismatches") or r.get("rel_max_diff", 0) > 2e-2]
    report["ok"] = not bad
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("moe route gpu " + ("ok" if not bad else f"FAILED: {bad}"))
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
