"""Does a multi-row forward (the MTP verify step's) give its row 0 what a one-row forward gives it, by depth?

    python bench/verify_rows.py --model glm-5.1 --weights fp8 --context 1024 --rows 2 4 --depths 1 2 3 4 8 16 32 78

Why: decode_speed's forced MTP rows at GLM-5.1's depth part from the plain decode at their first token. Row 0 of a
verify forward sees the same prefix as the plain step's one row (causal), so any difference is the kernels' rounding
for another row count (other tiles, other programs, another reduction order), unless something is wrong. Rounding
alone starts near the activations' precision at one layer and grows with depth, fastest where a MoE router's top-k
flips; a fault shows as a jump at a layer. Built as decode_speed builds (random weights on the device, the speed path
on CUDA; the DeepSeek family's layers past the first MoE layer alias its weights); the model runs truncated to each
depth (its spec's num_layers) from the same injected state. Per depth and row count: row 0's relative difference of
the final normed hidden state and of the logits against the one-row forward, the one-row forward's top-2 margin and
whether the argmax agrees; beside them each forward run twice (its own run-to-run difference: a race shows there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||a|| in float32 (0 when both are zero)."""
    a, b = a.float(), b.float()
    n = a.norm()
    return float((a - b).norm() / n) if n > 0 else float((a - b).norm())


def row0(model, engine, state, spec, depth: int, ids: list[int], window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, normed hidden) of row 0 of a forward over ids at positions c.. from the injected state, `depth` layers."""
    model.spec = spec
    engine.inject(state)
    model.spec = dataclasses.replace(spec, num_layers=depth)
    try:
        c = state.seq_len
        with torch.no_grad():
            logits, h = model.forward(torch.tensor(ids, dtype=torch.long, device=device), torch.arange(c, c + len(ids), device=device), window)
        return logits[0].float().clone(), h[0].float().clone()
    finally:
        model.spec = spec


def measure(model, engine, state, spec, depths: list[int], rows: list[int], window: int, device: torch.device, seed: int = 0) -> list[dict]:
    """One entry per depth: the one-row forward's repeat difference and margin, and row 0's differences per row count."""
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(4, spec.vocab_size, (max(rows),), generator=gen).tolist()
    out = []
    for d in depths:
        logits1, h1 = row0(model, engine, state, spec, d, [3], window, device)
        again_logits, again_h = row0(model, engine, state, spec, d, [3], window, device)
        top2 = logits1.topk(2).values
        entry = {"depth": d, "margin": float(top2[0] - top2[1]), "logit_scale": float(logits1.abs().max()),
                 "repeat": {"hidden_rel": rel(h1, again_h), "logits_rel": rel(logits1, again_logits)}, "rows": {}}
        for r in rows:
            lg, h = row0(model, engine, state, spec, d, [3] + extra[: r - 1], window, device)
            _, h_again = row0(model, engine, state, spec, d, [3] + extra[: r - 1], window, device)
            entry["rows"][str(r)] = {"hidden_rel": rel(h1, h), "logits_rel": rel(logits1, lg), "logits_max_abs": float((logits1 - lg).abs().max()),
                                     "argmax_agrees": bool(logits1.argmax() == lg.argmax()), "repeat_hidden_rel": rel(h, h_again)}
        out.append(entry)
        line = " ".join(f"rows {r}: h {v['hidden_rel']:.2e} logits {v['logits_rel']:.2e}{'' if v['argmax_agrees'] else ' (argmax differs)'}"
                        for r, v in entry["rows"].items())
        print(f"depth {d:3d}: repeat h {entry['repeat']['hidden_rel']:.1e}, margin {entry['margin']:.3g} of {entry['logit_scale']:.3g}; {line}",
              file=sys.stderr, flush=True)
    return out


def main() -> None:
    from kit import CONFIGS, build_weights, model_spec, random_state
    from tilepd.engine import layers, moe
    from tilepd.engine.compiled import accelerate
    from tilepd.engine.engine import Engine, build_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=[m for m in CONFIGS if m != "llama3-8b"], default="glm-5.1")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--layers", type=int, default=None, help="the model's depth (default: the named model's)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4], help="row counts of the multi-row forwards (MTP verify: k+1)")
    ap.add_argument("--depths", type=int, nargs="+", default=None, help="depths to run (default: 1, 2, 4, 8, ... and the model's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny stand-in shapes (CPU tests)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if any(r < 2 for r in args.rows):
        raise SystemExit(f"--rows {args.rows}: each row count must be at least 2")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, spec, built = model_spec(args.model, tiny=args.tiny, layers=args.layers)
    depths = args.depths or sorted({*(1 << i for i in range(spec.num_layers.bit_length()) if 1 << i < spec.num_layers), spec.num_layers})
    bad = [d for d in depths if not 1 <= d <= spec.num_layers]
    if bad:
        raise SystemExit(f"--depths {bad}: outside 1..{spec.num_layers} (the model's depth)")
    weights = build_weights(spec, built, device, dtype, args.weights)
    window = args.context + max(args.rows) + 16
    layers.ATTENTION_IMPL["mla"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"] = "reference", "gather", "torch", "torch"
    model = build_model(spec, weights, window, device, dtype)
    path = accelerate(model) if device.type == "cuda" else None
    engine = Engine(model, spec, device, window, use_cuda_graph=False, num_speculative_tokens=0)
    state = random_state(spec, args.context, device, dtype)
    report = {"model": args.model, "weights": args.weights, "layers": spec.num_layers, "context": args.context, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": torch.__version__,
              "path": path.name if path is not None else "reference", "rows": args.rows,
              "depths": measure(model, engine, state, spec, depths, args.rows, window, device)}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
