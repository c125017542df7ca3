"""The MLA kernel and the expert GEMV on the GPU give the reference path's greedy tokens (float32, tiny shapes).

For a tiny DeepSeek-V3 (dense MLA, bf16-style dense experts) and a tiny GLM-5 (DSA: index_topk 16, so a
300-token context really attends sparsely), both with random weights built on the device (no download, no
HF), each injected with the same random prefix state (40 and 300 tokens):
  - `graph`: CUDA graphs, MLA and experts on the reference path (SDPA / gather+matmul, gather+einsum);
  - `speed-path`: compiled.accelerate (MLA kernel + expert GEMV + router kernel) in CUDA graphs, windows changing mid-run;
  - `speed-path+mtp` / `+mtp3`: the same kernels in the MTP step's CUDA graphs (mtp.MtpStep, k=1 / k=3:
    verify steps of 2 / 4 tokens); `+mtp3-oracle`: k=3 with drafts from the reference tokens, every 5th wrong
    (accepted and rejected drafts in one run; the random MTP layer alone is almost never accepted).
A tiny Llama goes through its speed path too (split-KV attention, the per-layer functions compiled with
compiled.SPEED_COMPILE_OPTIONS). float32 everywhere, so the greedy tokens must be identical. Prints one OK/FAIL line per case, exits 1 on a FAIL.

    python bench/mla_gpu_parity.py [--tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import TINY_DSV3, TINY_GLM5, TINY_LLAMA, random_state
from tilepd.dev.synthetic import random_runtime_weights
from tilepd.engine import layers, moe
from tilepd.engine.compiled import accelerate
from tilepd.engine.engine import Engine, build_model
from tilepd.model_format.model_spec import spec_from_hf_config
from tilepd.engine.types import SamplingParams


def decode(spec, weights, device, variant: str, context: int, tokens: int, oracle: list[int] | None = None) -> tuple[list[int], str]:
    layers.ATTENTION_IMPL["mla"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "reference", "gather", "torch"
    max_seq = context + tokens + 64
    model = build_model(spec, weights, max_seq, device, torch.float32)
    # Llama's speed path compiles its per-layer functions (Inductor's coordinate descent); the DeepSeek family has no compiled part
    path = accelerate(model, compile_layers=spec.family == "llama") if variant.startswith("speed-path") else None
    mtp = "+mtp" in variant
    engine = Engine(model, spec, device, max_seq, use_cuda_graph=True, num_speculative_tokens=(3 if "+mtp3" in variant else 1) if mtp else 0)
    if engine.graph_step is not None:
        engine.graph_step.buckets = [context + 8, context + 24, max_seq]  # windows change during the run
        engine.graph_step.fallbacks = list(path.fallbacks) if path is not None else []
    if oracle is not None:
        from tilepd.engine.mtp import mtp_step

        mtp_step(engine).set_oracle([0] * context + [3] + [(t + 1) % spec.vocab_size if i % 5 == 4 else t for i, t in enumerate(oracle)])
    engine.inject(random_state(spec, context, device, torch.float32))
    res = engine.decode(3, tokens, SamplingParams(ignore_eos=True), lambda t: None)
    gs = engine.graph_step
    note = (f"path={path.name if path else 'plain'} switches=mla:{layers.ATTENTION_IMPL['mla']},experts:{moe.EXPERT_IMPL['dense']},"
            f"router:{moe.ROUTE_IMPL['router']}")
    if gs is not None and gs.capture_error:
        note += f" capture_error={gs.capture_error[:120]}"
    if mtp:
        note += f" spec={engine.last_mtp_stats} mtp_graphs={len(engine._mtp_step.graphs)}"
        if engine._mtp_step.capture_error:
            note += f" capture_error={engine._mtp_step.capture_error[:120]}"
    layers.ATTENTION_IMPL["mla"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "reference", "gather", "torch"
    return res.tokens, note


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    device = torch.device("cuda")
    failed = False
    for name, cfg in (("llama-tiny", TINY_LLAMA), ("dsv3-tiny", TINY_DSV3), ("glm5-tiny", TINY_GLM5)):
        spec = spec_from_hf_config(cfg)
        weights = random_runtime_weights(spec, device, torch.float32)
        for context in (40, 300):
            try:
                want, _ = decode(spec, weights, device, "graph", context, args.tokens)
            except Exception:
                traceback.print_exc()
                print(f"FAIL {name} ctx={context} reference path raised")
                failed = True
                continue
            variants = ("speed-path",) if spec.family == "llama" else ("speed-path", "speed-path+mtp", "speed-path+mtp3", "speed-path+mtp3-oracle")
            for variant in variants:
                try:
                    got, note = decode(spec, weights, device, variant, context, args.tokens, want if variant.endswith("oracle") else None)
                    ok = got == want and "capture_error" not in note
                    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
                    print(f"{'OK  ' if ok else 'FAIL'} {name} ctx={context} {variant:15s} tokens={len(got)} first_diff={first} {note}", flush=True)
                except Exception as e:
                    traceback.print_exc()
                    print(f"FAIL {name} ctx={context} {variant} raised {type(e).__name__}: {e}", flush=True)
                    ok = False
                failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
