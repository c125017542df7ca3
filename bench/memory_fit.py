"""GPU memory of a real decode engine against rule memory-fit's estimate (tilepd/topology/memory_fit.py).

On one CUDA GPU, for each model and max_seq_len, in a fresh process: random bf16 weights built on the GPU (no disk),
the engine the decode server runs (speed path, CUDA graphs captured, MTP when the model has it), a prefix injected
and 16 tokens decoded; then the device's used memory (total - free: CUDA context, allocator, cuBLAS, graph pools)
against the estimate's parts. The figure that matters is `workspace measured` (used - weights - caches) against
the allowance the rule adds per GPU (2 GiB + RoPE table): if it is larger, the rule lets too much through.

    python bench/memory_fit.py --model llama8b --max-seq-len 8192 65536
    python bench/memory_fit.py --model dsv3 --layers 4 --max-seq-len 16384 163840
    python bench/memory_fit.py --device cpu --model tiny-llama tiny-dsv3 --max-seq-len 256     # the code path only
    ... --json

The receive buffer is not allocated here (it is the runtime's; its size is the formula in tilepd/runtime/geometry.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.topology.gpus import GIB
from tilepd.topology.known_models import KNOWN_MODELS

_DSV3 = {k: v for k, v in KNOWN_MODELS["deepseek-ai/DeepSeek-V3"].config.items() if k != "quantization_config"}
_TINY_DSV3 = {**_DSV3, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 2,
              "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
              "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "num_hidden_layers": 2,
              "first_k_dense_replace": 1}
_LLAMA8B = KNOWN_MODELS["meta-llama/Meta-Llama-3-8B"].config
MODELS = {
    "llama8b": _LLAMA8B,
    "dsv3": _DSV3,
    "tiny-llama": {**_LLAMA8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2},
    "tiny-dsv3": _TINY_DSV3,
}


def model_config(name: str, layers: int | None) -> dict:
    cfg = dict(MODELS[name])
    if layers:
        cfg["num_hidden_layers"] = layers
        if "first_k_dense_replace" in cfg:
            cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], max(layers - 1, 0))
    return cfg


def measure(cfg: dict, max_seq_len: int, device: str, out: mp.Queue) -> None:
    """One case in its own process: build, capture, decode; report measured bytes and the estimate's parts."""
    import torch

    from tilepd.dev.synthetic import random_runtime_weights
    from tilepd.engine.engine import build_model, engine_for
    from tilepd.model_format.model_spec import spec_from_hf_config
    from tilepd.engine.types import KVState, SamplingParams
    from tilepd.topology.memory_fit import DecodeSetting, decode_parts, decode_policy, weight_bytes as estimate_weights

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.init()
        torch.zeros(1, device=dev)
        free, total = torch.cuda.mem_get_info(dev)
        context = total - free
    spec = spec_from_hf_config(cfg).with_cache_dtype(str(dtype).removeprefix("torch."))
    weights = random_runtime_weights(spec, dev, dtype)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    if cuda:
        torch.cuda.empty_cache()  # the builder's temporaries: the server's loader frees its own the same way
    model = build_model(spec, weights, max_seq_len, dev, dtype)
    mtp = 1 if getattr(model, "has_mtp", False) else 0
    engine = engine_for(model, spec, dev, max_seq_len, use_cuda_graph=cuda, num_speculative_tokens=mtp, speed_path=cuda)
    caches = [*getattr(model, "caches", []), *getattr(model, "mtp_caches", []), *getattr(model, "index_caches", {}).values()]
    cache_bytes = sum(c.numel() * c.element_size() for c in caches if isinstance(c, torch.Tensor))
    engine.warmup(max_windows=1)
    context_len = min(max_seq_len // 2, 4096)
    gen = torch.Generator(device=dev).manual_seed(1)
    shape = (context_len, *model.caches[0].shape[1:])
    engine.inject(KVState(context_len, [torch.randn(*shape, generator=gen, device=dev, dtype=dtype) * 0.5 for _ in model.caches]))
    engine.decode(0, 16, SamplingParams(ignore_eos=True), lambda t: None)
    parts, _ = decode_parts(spec, DecodeSetting("bf16", 1, max_seq_len, recv_vram=False), "auto")
    main_w, mtp_w = estimate_weights(spec, 1, decode_policy("bf16", str(dtype).removeprefix("torch.")))  # the gate as these weights hold it
    est = {"weights": main_w + mtp_w, "caches": parts["kv_cache"] + parts["indexer_cache"] + parts["mtp"] - mtp_w,
           "workspace": parts["workspace"], "total": sum(parts.values())}
    row = {"model_type": spec.model_type, "layers": spec.num_layers, "max_seq_len": max_seq_len, "estimate": est,
           "measured_weights": weight_bytes, "measured_caches": cache_bytes, "speed_path": str(getattr(engine, "speed_path", ""))}
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(dev)
        row.update(used=total - free, context=context, peak_reserved=torch.cuda.max_memory_reserved(dev))
        row["workspace_measured"] = row["used"] - weight_bytes - cache_bytes
    out.put(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["llama8b"], choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (DeepSeek-V3's 61 do not fit one GPU in bf16)")
    ap.add_argument("--max-seq-len", type=int, nargs="+", default=[8192])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for name in args.model:
        for n in args.max_seq_len:
            q: mp.Queue = ctx.Queue()
            p = ctx.Process(target=measure, args=(model_config(name, args.layers), n, args.device, q))
            p.start()
            p.join()
            if p.exitcode != 0:
                print(f"{name} max_seq_len {n}: the measuring process failed (exit {p.exitcode})", file=sys.stderr)
                return 1
            rows.append({"model": name, **q.get()})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    g = lambda b: f"{b / GIB:7.2f}"  # noqa: E731
    print("model       max_seq  weights est/meas   caches est/meas    workspace est/meas  used     est total  fits")
    for r in rows:
        e, used = r["estimate"], r.get("used")
        na = "    n/a"
        print(f"{r['model']:<11} {r['max_seq_len']:>7}  {g(e['weights'])}/{g(r['measured_weights'])}  {g(e['caches'])}/{g(r['measured_caches'])}  "
              f"{g(e['workspace'])}/{g(r['workspace_measured']) if used else na}  {g(used) if used else na}  {g(e['total'])}  "
              f"{'' if used is None else ('yes' if used <= e['total'] else 'NO: the rule under-estimates')}")
    print("(GiB; weights and caches include the MTP layers'; workspace measured = used - weights - caches, CUDA context included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
