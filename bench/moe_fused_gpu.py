"""The fused MoE block (tilepd/engine/moe_fused.py) on the GPU: parity with today's ops, launches and time per block.

    python bench/moe_fused_gpu.py --out bench/results/moe_fused_gpu.json      # one H200, ~1-2 minutes
    TRITON_INTERPRET=1 python bench/moe_fused_gpu.py --device cpu --tiny      # the same code on tiny shapes (the test suite)

For GLM-5.1's and DeepSeek-V3's MoE layer (shapes from bench/decode_speed.py's table: 256 experts, top-8, one shared
expert; GLM-5.1 one group, DeepSeek-V3 8 groups best 4), bf16 and block-scaled fp8 experts, random weights:

1. parity, T = 1, 2, 4 (MTP verify rows), --trials random rows each: the fused block (4 launches) against today's
   speed path for the same half layer, rms_norm + moe.moe_grouped + the residual add. Per case: tokens whose expert set
   differs (with the reference's gap between its k-th and (k+1)-th choice score there: a near-tie flipped by float32
   summation order or by a normed-row element rounded the other way; above NEAR_TIE it fails), normed-row elements that
   differ (the kernel's 1/rms against torch's, an ulp apart at times), and the max abs and relative error of the output on the tokens
   routed alike (relative to the MoE output's max abs).
2. launches per block: one block captured in a CUDA graph, replays under torch.profiler, kernels counted per replay.
3. time per block inside a CUDA graph (bench/kit.py's graph_time_us: 20 blocks in one graph, best of 5
   replays), fused vs today's, T = 1 and 4, with each fused kernel alone (and the plain grouped gate-up GEMV of the
   unfused path, without silu-mul, for comparison); bytes each must read, GB/s and % of the device's read bandwidth
   (kit.read_bandwidth, measured first).
4. --sweep (default on, --no-sweep skips): the gate, gate-up and down kernels' tile settings at T = 1 (gate: fp8 cases
   only, it reads the same bytes in both), each kernel timed alone, so the defaults in moe_fused_triton.TUNE can follow
   the device; each kernel's fastest setting per case is reported as "best".

The last lines printed are a short table (case, us and % of read bandwidth per kernel).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import CONFIGS, graph_time_us, read_bandwidth
from tilepd.engine import layers, moe, moe_fused, moe_fused_triton
from tilepd.engine.cuda_graph import capture_graph
from tilepd.model_format.block_fp8 import BlockFp8, quantize
from tilepd.engine.route_triton import route_logits

MODELS = ("glm-5.1", "deepseek-v3")
GATE_SWEEP = [(1, 8192, 4), (1, 8192, 8), (2, 8192, 8), (2, 8192, 16), (4, 8192, 16), (2, 2048, 8)]  # (block_e, block_k, warps)
UP_SWEEP = [(8, 1024, 4), (8, 512, 4), (16, 512, 4), (16, 1024, 8), (8, 2048, 8)]  # (block_n, block_k, warps)
DOWN_SWEEP = [(4, 2048, 2), (4, 2048, 4), (8, 1024, 4), (8, 2048, 8), (16, 1024, 8)]  # (block_n, block_k, warps)
NEAR_TIE = 1e-3


def layer_spec(model: str, tiny: bool) -> SimpleNamespace:
    c = CONFIGS[model][1 if tiny else 0]
    return SimpleNamespace(hidden=c["hidden_size"], inter=c["moe_intermediate_size"], experts=c["n_routed_experts"], n_group=c["n_group"],
                           topk_group=c["topk_group"], num_experts_per_tok=c["num_experts_per_tok"], norm_topk_prob=c["norm_topk_prob"],
                           routed_scaling_factor=c["routed_scaling_factor"], rms_norm_eps=c["rms_norm_eps"])


def _fp8(w: torch.Tensor) -> BlockFp8:
    if w.dim() == 2:
        return quantize(w)
    parts = [quantize(w[e]) for e in range(w.shape[0])]
    return BlockFp8(torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts]), parts[0].block)


def layer_weights(s: SimpleNamespace, fmt: str, dev: torch.device, dtype: torch.dtype, seed: int = 1) -> dict:
    """One MoE layer's weights under prefix "l." (the engine's names): random; the router gate bf16 as the served
    checkpoints hold it and convert-weights stores it (its bytes are what the gate kernel reads), its bias float32."""
    g = torch.Generator(device=dev).manual_seed(seed)
    h, i, e = s.hidden, s.inter, s.experts
    w = {"l.mlp_norm": (1 + 0.1 * torch.randn(h, generator=g, device=dev)).to(dtype),
         "l.gate": (torch.randn(e, h, generator=g, device=dev) * h ** -0.5).to(torch.bfloat16), "l.gate_bias": torch.randn(e, generator=g, device=dev) * 0.1}
    for name, shape in (("experts_w13", (e, 2 * i, h)), ("experts_w2", (e, h, i)), ("shared_w13", (2 * i, h)), ("shared_w2", (h, i))):
        v = torch.randn(*shape, generator=g, device=dev, dtype=dtype) * shape[-1] ** -0.5
        w["l." + name] = _fp8(v) if fmt == "fp8" else v
        del v
    return w


def _nb(t) -> int:  # noqa: ANN001 - a tensor or BlockFp8
    return t.nbytes() if isinstance(t, BlockFp8) else t.numel() * t.element_size()


def kernel_bytes(w: dict, s: SimpleNamespace) -> dict:
    """What one token's block must read, per kernel: the router gate; the k routed and the shared expert's gate-up
    weights (+ scales); their down weights (+ scales). Activations are a few KB and left out."""
    k = s.num_experts_per_tok
    return {"gate": _nb(w["l.gate"]), "gate_up": int(k * _nb(w["l.experts_w13"]) / s.experts + _nb(w["l.shared_w13"])),
            "down": int(k * _nb(w["l.experts_w2"]) / s.experts + _nb(w["l.shared_w2"]))}


def block_bytes(w: dict, s: SimpleNamespace) -> int:
    return sum(kernel_bytes(w, s).values())


def today(x: torch.Tensor, w: dict, s: SimpleNamespace) -> torch.Tensor:
    """Today's speed path for the MoE half layer: rms_norm, moe_grouped (8 launches), the residual add."""
    return x + moe.moe_grouped(layers.rms_norm(x, w["l.mlp_norm"], s.rms_norm_eps), w, "l.", s)


def fused(x: torch.Tensor, w: dict, s: SimpleNamespace) -> torch.Tensor:
    return moe_fused.moe_block(x, w, "l.", s)


def parity(x: torch.Tensor, w: dict, s: SimpleNamespace) -> dict:
    """One batch of rows: expert-set mismatches (with the reference's choice gap there), normed-row differences, errors."""
    k = s.num_experts_per_tok
    h_ref = layers.rms_norm(x, w["l.mlp_norm"], s.rms_norm_eps)
    logits = F.linear(h_ref.float(), w["l.gate"].float())
    ref_ids, _ = route_logits(logits, w["l.gate_bias"], s.n_group, s.topk_group, k, s.norm_topk_prob, s.routed_scaling_factor)
    h, ids, _, _ = moe_fused_triton.gate_route(x, w["l.mlp_norm"], s.rms_norm_eps, w["l.gate"], w["l.gate_bias"], s.n_group, s.topk_group, k,
                                               s.norm_topk_prob, s.routed_scaling_factor)
    same = (ids[:, :k].sort(-1)[0] == ref_ids.sort(-1)[0]).all(-1)
    choice = (torch.sigmoid(logits) + w["l.gate_bias"]).sort(-1, descending=True)[0]
    gaps = [float(choice[t, k - 1] - choice[t, k]) for t in range(x.shape[0]) if not same[t]]
    got, want = fused(x, w, s).float(), today(x, w, s).float()
    moe_scale = float((want - x.float()).abs().max())
    err = (got - want).abs()[same]
    return {"rows": x.shape[0], "id_mismatches": int((~same).sum()), "mismatch_choice_gaps": gaps, "h_elements_differ": int((h != h_ref).sum()),
            "max_abs": float(err.max()) if err.numel() else 0.0, "moe_out_max_abs": moe_scale}


def count_launches(fn, dev: torch.device, replays: int = 5) -> dict | None:  # noqa: ANN001 - a callable
    """Kernels per call of `fn` as the decode step's graph runs it: one call captured, `replays` replays profiled."""
    if dev.type != "cuda":
        return None
    graph = capture_graph(fn, [])
    graph.replay()
    torch.cuda.synchronize()
    per: dict[str, int] = defaultdict(int)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += 1
    del graph
    return {"launches": sum(per.values()) / replays, "kernels": {name[:90]: n / replays for name, n in sorted(per.items())}}


def _time_us(fn, dev: torch.device) -> float:  # noqa: ANN001 - a callable
    """us per call in a CUDA graph; on CPU (the interpreter: seconds a call) one call, only so the code runs."""
    return graph_time_us(fn, dev, reps=20 if dev.type == "cuda" else 1)


def kernel_calls(x: torch.Tensor, w: dict, s: SimpleNamespace) -> dict:
    """The fused block's kernels as separate calls (the gate with its route launch) on one batch (each reads the previous one's outputs), and the
    unfused path's grouped gate-up GEMV (no silu-mul) on the same rows for comparison."""
    from tilepd.engine import fp8_triton
    from tilepd.engine.moe_triton import expert_gemv

    k = s.num_experts_per_tok
    args = (x, w["l.mlp_norm"], s.rms_norm_eps, w["l.gate"], w["l.gate_bias"], s.n_group, s.topk_group, k, s.norm_topk_prob, s.routed_scaling_factor)
    h, ids, weights, _ = moe_fused_triton.gate_route(*args)
    w13, s13 = w["l.experts_w13"], w["l.shared_w13"]
    if isinstance(w13, BlockFp8):
        def grouped() -> torch.Tensor:
            return fp8_triton.launch(h, w13.weight, w13.scale, ids.view(-1), None, w13.block[0], w13.block[1], shared=(s13.weight, s13.scale), x_div=k + 1)
    else:
        def grouped() -> torch.Tensor:
            return expert_gemv(h, w13, ids.view(-1), shared=s13, x_div=k + 1)
    a = moe_fused_triton.gate_up_act(h, w13, s13, ids)
    return {"gate": lambda: moe_fused_triton.gate_route(*args), "gate_up": lambda: moe_fused_triton.gate_up_act(h, w13, s13, ids),
            "down": lambda: moe_fused_triton.down_combine(a, w["l.experts_w2"], w["l.shared_w2"], ids, weights, x), "gate_up_grouped": grouped}


def _best(times: dict) -> str:
    return min(times, key=times.get) if times else ""


def sweep(x: torch.Tensor, w: dict, s: SimpleNamespace, dev: torch.device, gate: bool) -> dict:
    """The gate's (when `gate`), the gate-up's and the down kernel's tile settings, each kernel alone (us); TUNE is
    restored after."""
    saved = dict(moe_fused_triton.TUNE)
    out: dict[str, dict] = {"gate": {}, "gate_up": {}, "down": {}}
    try:
        for be, bk, nw in GATE_SWEEP if gate else []:
            moe_fused_triton.TUNE.update(saved, gate_block_e=be, gate_block_k=bk, gate_num_warps=nw)
            out["gate"][f"block_e={be},block_k={bk},warps={nw}"] = _time_us(kernel_calls(x, w, s)["gate"], dev)
        for bn, bk, nw in UP_SWEEP:
            moe_fused_triton.TUNE.update(saved, up_block_n=bn, up_block_n_fp8=bn, up_block_k=bk, up_block_k_fp8=bk, up_num_warps=nw)
            out["gate_up"][f"block_n={bn},block_k={bk},warps={nw}"] = _time_us(kernel_calls(x, w, s)["gate_up"], dev)
        for bn, bk, nw in DOWN_SWEEP:
            moe_fused_triton.TUNE.update(saved, down_block_n=bn, down_block_k=bk, down_block_k_fp8=bk, down_num_warps=nw)
            out["down"][f"block_n={bn},block_k={bk},warps={nw}"] = _time_us(kernel_calls(x, w, s)["down"], dev)
    finally:
        moe_fused_triton.TUNE.update(saved)
    out["best"] = {name: _best(times) for name, times in out.items()}
    return out


def _setting(key: str) -> dict:
    """A sweep key ("block_n=8,block_k=1024,warps=4") as its settings by name ("": none)."""
    return dict((name, int(v)) for name, v in (part.split("=") for part in key.split(","))) if key else {}


def tuned(x: torch.Tensor, w: dict, s: SimpleNamespace, dev: torch.device, best: dict) -> dict:
    """The block and its kernels again with each kernel's fastest sweep setting for this case (TUNE restored after)."""
    saved = dict(moe_fused_triton.TUNE)
    try:
        for kernel, prefix in (("gate", "gate_"), ("gate_up", "up_"), ("down", "down_")):
            for name, v in _setting(best.get(kernel) or "").items():
                name = "num_warps" if name == "warps" else name
                both = kernel != "gate" and (name == "block_k" or (kernel == "gate_up" and name == "block_n"))  # the fp8 key too
                moe_fused_triton.TUNE.update({prefix + name: v, **({prefix + name + "_fp8": v} if both else {})})
        out = {"tune": dict(moe_fused_triton.TUNE), "fused_us": _time_us(lambda: fused(x, w, s), dev)}
        out.update({f"{name}_us": _time_us(fn, dev) for name, fn in kernel_calls(x, w, s).items() if name != "gate_up_grouped"})
        return out
    finally:
        moe_fused_triton.TUNE.update(saved)


def run_case(model: str, fmt: str, args, dev: torch.device, dtype: torch.dtype) -> list[dict]:  # noqa: ANN001 - argparse namespace
    s = layer_spec(model, args.tiny)
    w = layer_weights(s, fmt, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(2)
    rows = []
    for t in (1, 2, 4):
        assert moe_fused.applies(torch.zeros(t, s.hidden, device=dev, dtype=dtype), w, "l.", s), f"the fused block must apply ({model} {fmt} T={t})"
        parts = [parity(torch.randn(t, s.hidden, generator=g, device=dev).to(dtype) * 2, w, s) for _ in range(args.trials)]
        row = {"case": f"{model} {fmt} T={t}", "tokens": sum(p["rows"] for p in parts), "id_mismatches": sum(p["id_mismatches"] for p in parts),
               "mismatch_choice_gaps": [gap for p in parts for gap in p["mismatch_choice_gaps"]],
               "h_elements_differ": sum(p["h_elements_differ"] for p in parts), "max_abs": max(p["max_abs"] for p in parts)}
        row["max_rel"] = row["max_abs"] / max(p["moe_out_max_abs"] for p in parts)
        if t in ((1, 4) if dev.type == "cuda" else (1,)):
            x = torch.randn(t, s.hidden, generator=g, device=dev).to(dtype)
            row["fused_us"] = _time_us(lambda: fused(x, w, s), dev)
            row["today_us"] = _time_us(lambda: today(x, w, s), dev)
            row["fused_GBps"] = block_bytes(w, s) / (row["fused_us"] * 1e-6) / 1e9 if t == 1 else None  # T = 1: bytes of one token's experts
            row.update({f"{name}_us": _time_us(fn, dev) for name, fn in kernel_calls(x, w, s).items()})
            if t == 1:
                for name, nbytes in kernel_bytes(w, s).items():
                    row[f"{name}_MB"] = nbytes / 1e6
                    row[f"{name}_GBps"] = nbytes / (row[f"{name}_us"] * 1e-6) / 1e9
                    row[f"{name}_pct_bw"] = 100 * row[f"{name}_GBps"] / args.read_GBps if args.read_GBps else None
            row["fused_launches"] = count_launches(lambda: fused(x, w, s), dev)
            row["today_launches"] = count_launches(lambda: today(x, w, s), dev)
            if t == 1 and args.sweep and dev.type == "cuda":
                row["sweep"] = sweep(x, w, s, dev, gate=fmt == "fp8")
                print(json.dumps({"case": row["case"], "sweep": row["sweep"]}), flush=True)
                row["tuned"] = tuned(x, w, s, dev, row["sweep"]["best"])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("sweep",)}), flush=True)
    w.clear()  # the layer's weights (tens of GB at full size) go before the next case's
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_table(report: dict) -> None:
    """The short table for people: per T = 1 case, each kernel's us and % of the read bandwidth, and the sweep's picks."""
    print(f"read bandwidth {report['read_GBps']} GB/s; tune {report['tune']}")
    print("case | block us (today) | gate us %bw | gate-up us %bw (grouped GEMV us) | down us %bw | id mismatches | max rel")
    for r in report["rows"]:
        if "fused_us" not in r or not r["case"].endswith("T=1"):
            continue
        def cell(name: str) -> str:
            pct = r.get(f"{name}_pct_bw")
            return f"{r[name + '_us']:.1f} {pct:.0f}%" if pct is not None else f"{r[name + '_us']:.3g}"
        print(f"{r['case']} | {r['fused_us']:.1f} ({r['today_us']:.1f}) | {cell('gate')} | {cell('gate_up')} ({r['gate_up_grouped_us']:.1f}) | "
              f"{cell('down')} | {r['id_mismatches']} | {r['max_rel']:.2e}")
        if "sweep" in r:
            tu = r["tuned"]
            print(f"   sweep best: {r['sweep']['best']}; with them: block {tu['fused_us']:.1f}, gate {tu['gate_us']:.1f}, "
                  f"gate-up {tu['gate_up_us']:.1f}, down {tu['down_us']:.1f} us")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny stand-in shapes of decode_speed.py's table (CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--trials", type=int, default=None, help="random batches per model, format and T (default 16; tiny 1)")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True, help="time the gate and down kernels' tile settings (CUDA)")
    ap.add_argument("--max-rel", type=float, default=2e-2, help="largest relative error that passes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.trials = args.trials or (1 if args.tiny else 16)
    dev = torch.device(args.device)
    args.read_GBps = read_bandwidth(dev, 4.0)["sum_read_GBps"] if dev.type == "cuda" else None
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    before = (moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"])
    moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "triton", "triton"  # moe_grouped's own kernels (it calls them directly)
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "dtype": str(dtype),
              "tune": dict(moe_fused_triton.TUNE), "read_GBps": args.read_GBps, "rows": []}
    try:
        for model in MODELS:
            for fmt in ("bf16", "fp8"):
                report["rows"] += run_case(model, fmt, args, dev, dtype)
    finally:
        moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = before
    # a flipped expert set must be a near-tie: choice scores within NEAR_TIE (float32 summation order, or a normed-row
    # element rounded the other way after an ulp of difference in 1/rms moves a score by ~1e-4 at most); else it fails
    bad = [r["case"] for r in report["rows"] if r["max_rel"] > args.max_rel or any(gap > NEAR_TIE for gap in r["mismatch_choice_gaps"])]
    launches = [r["fused_launches"]["launches"] for r in report["rows"] if r.get("fused_launches")]
    if launches and max(launches) > 3:
        bad.append(f"fused block launches {max(launches)} > 3")
    report["ok"] = not bad
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("moe fused gpu " + ("ok" if not bad else f"FAILED: {bad}"))
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
