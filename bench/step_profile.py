"""Where one batch-1 decode step's time goes on the GPU: kernel times per step, grouped by kernel, from the profiler.

    python bench/step_profile.py --model llama3-8b --context 1024            # the speed path
    python bench/step_profile.py --model llama3-8b --variant "speed-path[no-fused-gemv]"

Builds the model as bench/decode_speed.py does (random weights on the device), decodes once to capture the graphs,
then profiles a decode of --tokens tokens (CUDA graph replays; the profiler records the kernels inside them) and prints,
per kernel name, microseconds per step and launches per step, largest first, with the sum against the step's wall time
(the difference is the gaps between kernels: launch latency inside the graph and the host's per-step work).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_speed import CONFIGS, random_state, step_read_bytes, read_bandwidth  # noqa: E402
from tilepd.dev.synthetic import random_runtime_weights  # noqa: E402
from tilepd.engine import layers  # noqa: E402
from tilepd.engine.compiled import accelerate  # noqa: E402
from tilepd.engine.engine import Engine, build_model  # noqa: E402
from tilepd.engine.spec import spec_from_hf_config  # noqa: E402
from tilepd.engine.types import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(CONFIGS), default="llama3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--variant", default="speed-path", choices=["speed-path", "speed-path[no-fused-gemv]"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    spec = spec_from_hf_config(CONFIGS[args.model][0])
    bw = read_bandwidth(dev, 4.0)["sum_read_GBps"] * 1e9
    weights = random_runtime_weights(spec, dev, dtype)
    wb, kvb = step_read_bytes(spec, weights, args.context)
    floor_us = (wb + kvb) / bw * 1e6
    window = args.context + args.tokens + 16
    model = build_model(spec, weights, window, dev, dtype)
    path = accelerate(model, fused_gemv=args.variant == "speed-path")
    engine = Engine(model, spec, dev, window, use_cuda_graph=True, num_speculative_tokens=0)
    engine.graph_step.buckets = [window]
    engine.graph_step.fallbacks = list(path.fallbacks)
    state = random_state(spec, args.context, dev, dtype)
    params = SamplingParams(ignore_eos=True)
    engine.inject(state)
    engine.decode(3, 8, params, lambda t: None)  # capture
    engine.inject(state)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        res = engine.decode(3, args.tokens, params, lambda t: None)
        torch.cuda.synchronize()
    steps = len(res.tokens)
    step_us = res.timings["decode_ms"] / steps * 1e3
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name][1] += 1
    rows = sorted(((us / steps, n / steps, name) for name, (us, n) in per.items()), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"{args.model} {args.variant} ctx {args.context}: step {step_us:.1f} us (floor {floor_us:.1f} us, "
          f"{100 * floor_us / step_us:.1f}%), kernels {total:.1f} us/step, gaps {step_us - total:.1f} us/step, "
          f"path {path.name}, GEMV impl {layers.GEMV_IMPL['dense']}")
    for us, n, name in rows[: args.top]:
        print(f"  {us:8.1f} us/step  {n:6.1f}/step  {name[:110]}")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "variant": args.variant, "context": args.context, "step_us": step_us,
                                        "floor_us": floor_us, "kernels_us": total,
                                        "kernels": [{"name": nm, "us_per_step": us, "per_step": n} for us, n, nm in rows]}, indent=1))


if __name__ == "__main__":
    main()
