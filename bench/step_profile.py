"""Where one batch-1 decode step's time goes on the GPU: kernel times and launches per step and per layer, from the profiler.

    python bench/step_profile.py --model llama3-8b --context 1024            # the speed path
    python bench/step_profile.py --model llama3-8b --variants "speed-path[no-fused-gemv]"
    python bench/step_profile.py --model glm-5.1 --weights fp8 --context 1024 \\
        --variants "speed-path[no-moe-fused]" speed-path --out glm51_fp8_profile.json   # 78 layers, fused MoE block off/on

Builds the model as bench/decode_speed.py does (random weights on the device; DeepSeek family at the named model's
depth, --layers to change it, layers past the first MoE layer aliasing its weights), decodes once to capture the
graphs, then profiles a decode of --tokens tokens (CUDA graph replays; the profiler records the kernels inside them)
and prints per variant: the step's wall time against its read floor, kernel launches per step and per layer, the
gap time per step (wall time minus the kernels' time: launch latency inside the graph and the host's per-step work),
the GEMV time and the non-GEMV kernel time per layer, then per kernel name microseconds and launches per step,
largest first. "Per layer" divides the whole step by the main layers, so the embedding, head and sampling are
spread over them. A kernel counts as a GEMV when its name contains one of GEMV_NAME_MARKS (the weight-reading
matrix kernels: the Triton GEMVs and cuBLAS/CUTLASS ones).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMV_NAME_MARKS = ("gemv", "gemm", "xmma", "cutlass", "cublas")
VARIANTS = ["speed-path", "speed-path[no-fused-gemv]", "speed-path[no-moe-fused]", "speed-path[no-moe-route]", "speed-path[no-moe-gemv]",
            "speed-path[no-mla]", "speed-path[no-mla-fused]"]


def is_gemv_kernel(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in GEMV_NAME_MARKS)


def summarize_kernels(per_kernel: dict[str, tuple[float, int]], steps: int, layers: int, step_us: float, top: int | None = None) -> dict:
    """Profiler totals per kernel name (device us, launches) over `steps` decode steps of a model with `layers` main
    layers, whose step took `step_us` wall time -> the per-step and per-layer figures the bench rows carry."""
    if steps <= 0 or layers <= 0:
        raise ValueError(f"kernel summary needs steps > 0 and layers > 0 (got steps={steps}, layers={layers})")
    rows = sorted(((us / steps, n / steps, name) for name, (us, n) in per_kernel.items()), reverse=True)
    kernels_us = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    gemv_us = sum(r[0] for r in rows if is_gemv_kernel(r[2]))
    gemv_launches = sum(r[1] for r in rows if is_gemv_kernel(r[2]))
    return {"step_us": step_us, "kernels_us_per_step": kernels_us, "gaps_us_per_step": step_us - kernels_us,
            "launches_per_step": launches, "launches_per_layer": launches / layers,
            "gemv_us_per_step": gemv_us, "gemv_launches_per_step": gemv_launches,
            "non_gemv_us_per_step": kernels_us - gemv_us, "non_gemv_us_per_layer": (kernels_us - gemv_us) / layers,
            "gaps_us_per_layer": (step_us - kernels_us) / layers, "layers": layers,
            "kernels": [{"name": nm, "us_per_step": us, "per_step": n} for us, n, nm in rows[:top]]}


def profile_decode(engine, state, tokens: int, layers: int, top: int | None = 25, *, per_target_step: bool = False) -> dict:
    """One greedy decode of `tokens` tokens from `state` under the CUDA profiler (graphs already captured) ->
    summarize_kernels' figures, per token, or per_target_step: per MTP step (engine.last_mtp_stats' target steps,
    an engine with num_speculative_tokens > 0). CUDA only: the bench's CPU rows carry no profile."""
    from tilepd.engine.types import SamplingParams

    if engine.device.type != "cuda":
        raise ValueError(f"step profile needs a CUDA engine, not {engine.device}")
    params = SamplingParams(ignore_eos=True)
    engine.inject(state)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        res = engine.decode(3, tokens, params, lambda t: None)
        torch.cuda.synchronize()
    steps = engine.last_mtp_stats["target_steps"] if per_target_step else len(res.tokens)
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name][1] += 1
    return summarize_kernels({k: (v[0], int(v[1])) for k, v in per.items()}, steps, layers, res.timings["decode_ms"] / steps * 1e3, top)


def profile_line(p: dict) -> str:
    return (f"step {p['step_us']:.1f} us, {p['launches_per_step']:.0f} launches/step ({p['launches_per_layer']:.1f}/layer), "
            f"gaps {p['gaps_us_per_step']:.1f} us/step ({p['gaps_us_per_layer']:.2f}/layer), GEMV {p['gemv_us_per_step']:.1f} us/step "
            f"({p['gemv_launches_per_step']:.0f} launches), non-GEMV {p['non_gemv_us_per_layer']:.1f} us/layer")


def main() -> None:
    from kit import CONFIGS, build_weights, model_spec, random_state, read_bandwidth, step_read_bytes
    from tilepd.engine import layers, moe
    from tilepd.engine.compiled import accelerate
    from tilepd.engine.engine import Engine, build_model
    from tilepd.engine.types import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(CONFIGS), default="llama3-8b")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="bf16", help="fp8: block-scaled e4m3 GEMV weights, as decode_speed --weights fp8")
    ap.add_argument("--layers", type=int, default=None, help="DeepSeek family: main layers (default: the named model's depth)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32, help="tokens of the profiled decode")
    ap.add_argument("--timed-tokens", type=int, default=64, help="tokens of the timed decode before it (ms/token, %% of floor)")
    ap.add_argument("--variants", nargs="+", default=["speed-path"], choices=VARIANTS)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg, spec, built = model_spec(args.model, tiny=False, layers=args.layers)
    bw = read_bandwidth(dev, 4.0)["sum_read_GBps"] * 1e9
    weights = build_weights(spec, built, dev, dtype, args.weights)
    wb, kvb = step_read_bytes(spec, weights, args.context)
    floor_us = (wb + kvb) / bw * 1e6
    window = args.context + max(args.tokens, args.timed_tokens) + 16
    state = random_state(spec, args.context, dev, dtype)
    report = {"model": args.model, "weights": args.weights, "layers": spec.num_layers, "context": args.context, "gpu": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "read_GBps": bw / 1e9, "floor_us": floor_us, "weight_GB": wb / 1e9, "kv_GB": kvb / 1e9, "variants": {}}
    print(f"{args.model} {args.weights} {spec.num_layers} layers ctx {args.context}: floor {floor_us:.1f} us ({wb / 1e9:.2f} GB weights + "
          f"{kvb / 1e9:.3f} GB KV at {bw / 1e9:.0f} GB/s)", flush=True)
    for variant in args.variants:
        layers.ATTENTION_IMPL["default"], layers.ATTENTION_IMPL["mla"], layers.GEMV_IMPL["dense"] = "sdpa", "reference", "torch"
        moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"] = "gather", "torch", "torch"
        model = build_model(spec, weights, window, dev, dtype)
        off = variant.removeprefix("speed-path").strip("[]")
        path = accelerate(model, fused_gemv=off != "no-fused-gemv", moe_route=off != "no-moe-route", moe_gemv=off != "no-moe-gemv",
                          moe_fused=off != "no-moe-fused", mla_attention=off != "no-mla", mla_fused=off != "no-mla-fused")
        engine = Engine(model, spec, dev, window, use_cuda_graph=True, num_speculative_tokens=0)
        engine.graph_step.buckets = [window]
        engine.graph_step.fallbacks = list(path.fallbacks)
        engine.inject(state)
        engine.decode(3, 8, SamplingParams(ignore_eos=True), lambda t: None)  # capture
        engine.inject(state)
        torch.cuda.synchronize()
        timed = engine.decode(3, args.timed_tokens, SamplingParams(ignore_eos=True), lambda t: None)  # no profiler
        ms = timed.timings["decode_ms"] / len(timed.tokens)
        p = profile_decode(engine, state, args.tokens, spec.num_layers, top=args.top)
        p.update(path=path.name, ms_per_token=ms, pct_of_floor=100 * floor_us / (ms * 1e3), capture_error=engine.graph_step.capture_error,
                 first_tokens=timed.tokens[:16])
        report["variants"][variant] = p
        print(f"{variant} (path {path.name}): {ms:.3f} ms/token ({args.timed_tokens} tokens), {p['pct_of_floor']:.1f}% of floor; "
              f"profiled: {profile_line(p)}", flush=True)
        for k in p["kernels"]:
            print(f"  {k['us_per_step']:8.1f} us/step  {k['per_step']:6.1f}/step  {k['name'][:110]}")
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    layers.ATTENTION_IMPL["default"], layers.ATTENTION_IMPL["mla"] = "sdpa", "reference"
    moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"], layers.GEMV_IMPL["dense"] = "gather", "torch", "torch", "torch"
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
