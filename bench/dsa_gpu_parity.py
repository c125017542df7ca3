"""DSA (sparse attention) on the GPU speed path decodes HF transformers' greedy tokens (tiny glm5 / dsv32).

For each tiny DSA model and a prompt shorter than index_topk (10 tokens) and one 5x longer (80 tokens), the
engine on CUDA (captured graphs per cache window, compiled.accelerate speed path, float32 so the
comparison is exact) is injected with HF's prefill state (MLA latent + indexer keys) and must decode HF's
greedy continuation; the MTP speculative path is checked too. Prints one OK/FAIL line per case and
exits 1 on any FAIL. bf16 is reported for information only (its rounding may legitimately diverge
from an fp32 reference after some tokens).

Two halves, so the GPU machine needs only torch + tilepd + safetensors:

    python bench/dsa_gpu_parity.py --prepare DIR   # CPU, needs transformers: tiny models + HF references
    python bench/dsa_gpu_parity.py --check DIR     # CUDA: the engine against the saved references
    python bench/dsa_gpu_parity.py --prepare DIR --check DIR   # both, where transformers and CUDA are
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.engine import KVState, SamplingParams, load_engine

MODELS = ("glm5", "dsv32")
PROMPTS = {"short": 10, "long": 80}
STEPS = 32
GREEDY = SamplingParams(ignore_eos=True)


def prepare(out: Path) -> None:
    from tilepd.dev.hf_reference import hf_reference
    from tilepd.dev.tiny_model import make_tiny_model

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    for model in MODELS:
        path = make_tiny_model(model, out / model)
        for kind, n in PROMPTS.items():
            ids = torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(1)).tolist()
            ref = hf_reference(path, model, STEPS, prompt_ids=ids)
            torch.save({"seq_len": ref.state.seq_len, "layers": ref.state.layers, "indexer": ref.state.indexer,
                        "tokens": ref.tokens}, out / f"{model}-{kind}.pt")
            print(f"prepared {model}/{kind}: {n} prompt tokens, HF tokens {ref.tokens[:8]}...", flush=True)


def _decode(eng, ref: dict, dtype: torch.dtype) -> list[int]:
    state = KVState(ref["seq_len"], [x.to(dtype) for x in ref["layers"]], [None if x is None else x.to(dtype) for x in ref["indexer"]])
    eng.inject(state)
    return eng.decode(ref["tokens"][0], STEPS, GREEDY, lambda t: None).tokens


def check(out: Path, device: str = "cuda") -> bool:
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--check needs a CUDA device (or --device cpu: the graphs' static body, eagerly)")
    ok_all = True
    for model in MODELS:
        refs = {kind: torch.load(out / f"{model}-{kind}.pt") for kind in PROMPTS}
        for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            graph = load_engine(out / model, device=device, max_seq_len=256, dtype=dtype_name, use_cuda_graph=True, num_speculative_tokens=0)
            graph.graph_step.buckets = [16, 32, 64, 128, 256]  # windows below, at and above index_topk
            captured = graph.warmup()
            spec = load_engine(out / model, device=device, max_seq_len=256, dtype=dtype_name)
            for kind, ref in refs.items():
                want = ref["tokens"][1:]
                for path, eng in (("graph", graph), ("mtp-speculative", spec)):
                    got = _decode(eng, ref, dtype)
                    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
                    ok = got == want
                    if dtype == torch.float32:
                        ok_all &= ok
                        verdict = "OK" if ok else "FAIL"
                    else:
                        verdict = f"info: first {same}/{len(want)} tokens equal"
                    print(f"{model:6s} {kind:5s} {dtype_name:8s} {path:16s} speed_path={eng.speed_path} graphs={captured} "
                          f"{verdict}" + ("" if ok else f" (engine {got[:10]} vs HF {want[:10]})"), flush=True)
            del graph, spec
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return ok_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", type=Path, help="write tiny models + HF references here (needs transformers)")
    ap.add_argument("--check", type=Path, help="run the engine on CUDA against the references here")
    ap.add_argument("--device", default="cuda", help="--check device (cpu: a dry run of the script's logic)")
    args = ap.parse_args()
    if not args.prepare and not args.check:
        ap.error("give --prepare DIR and/or --check DIR")
    if args.prepare:
        prepare(args.prepare)
    if args.check:
        sys.exit(0 if check(args.check, args.device) else 1)


if __name__ == "__main__":
    main()
