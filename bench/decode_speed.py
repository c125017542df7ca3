"""Batch-1 decode speed of the tilepd engine vs the HBM read floor and HF transformers, in one run.

On a GPU (the target: one NVIDIA H200):

    python bench/decode_speed.py                       # Llama-3-8B-shaped, contexts 1K and 8K
    python bench/decode_speed.py --model dsv3-small    # DeepSeek-V3-shaped MoE, 1 dense + 1 MoE layer + MTP
    python bench/decode_speed.py --json > decode.json  # machine-readable

Everything is built on the device with random bf16 weights: no download, no disk. Figures printed:
the measured read bandwidth (GB/s), the floor per token = (weight bytes a step reads + KV bytes at that
context) / read bandwidth, and ms/token + % of floor for each engine variant: `graph` (whole step in a
CUDA graph; attention through torch SDPA), `graph[triton]` / `graph[bmm]` (same, attention through the
split-KV Triton kernel / as two batched GEMVs), `speed-path` (what `load_engine(device="cuda")` uses:
compiled.accelerate = torch.compile'd layers around the Triton attention, in the graph),
`compile+graph` (per-layer torch.compile including SDPA attention, then the graph; skipped with --no-compile),
`eager` (no graph, fewer tokens), and HF transformers `generate` (eager, batch 1, fewer tokens).
Each variant is isolated: a failure is reported in its row and the rest still run.

Variants `compile+graph` and `compile(no-attn)+graph` differ only in whether the cache-reading
attention is inside the compiled code. `--device cpu --tiny` runs the same code on a tiny shape (the test suite does, so this script cannot rot).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.dev.synthetic import random_runtime_weights  # noqa: E402
from tilepd.engine import layers  # noqa: E402
from tilepd.engine.compiled import accelerate  # noqa: E402
from tilepd.engine.engine import Engine, build_model  # noqa: E402
from tilepd.engine.spec import ModelSpec, spec_from_hf_config  # noqa: E402
from tilepd.engine.types import KVState, SamplingParams  # noqa: E402

LLAMA3_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
DSV3_SMALL = {  # DeepSeek-V3 per-layer shapes; 2 layers (1 dense, 1 MoE) + 1 MTP layer to fit one GPU
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
TINY_LLAMA = {**LLAMA3_8B, "bos_token_id": 0, "eos_token_id": 1, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
TINY_DSV3 = {**DSV3_SMALL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
             "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
             "topk_group": 2}


@dataclass
class Row:
    variant: str
    context: int
    tokens: int
    ms_per_token: float | None = None
    pct_of_floor: float | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: torch.device, gib: float) -> dict:
    """Best of several passes of a read-only reduction (sum) and a device-to-device copy over `gib` GiB."""
    n = int(gib * (1 << 30)) // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    out = {}
    for name, fn, factor in (("sum_read", lambda: x.sum(dtype=torch.float32), 1), ("copy_rw", lambda: y.copy_(x), 2)):
        fn()
        sync(device)
        best = float("inf")
        for _ in range(10 if device.type == "cuda" else 2):
            t0 = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        out[name + "_GBps"] = factor * x.numel() * 2 / best / 1e9
    del x, y
    return out


def step_read_bytes(spec: ModelSpec, weights: dict[str, torch.Tensor], context: int) -> tuple[float, float]:
    """(weight bytes one decode step reads, KV bytes at `context`). Embedding: one row; MoE: the routed
    experts a token uses (num_experts_per_tok of n_routed_experts) plus everything else once."""
    total = 0.0
    for name, w in weights.items():
        b = w.numel() * w.element_size()
        if name == "embed":
            b = w.shape[1] * w.element_size()
        elif name.endswith(("experts_w13", "experts_w2")):
            b *= spec.num_experts_per_tok / spec.n_routed_experts
        elif name.startswith("mtp."):
            continue  # the plain decode step does not run the MTP layer
        total += b
    itemsize = 2 if next(iter(weights.values())).dtype != torch.float32 else 4
    kv = spec.num_layers * context * spec.cache_heads * spec.cache_entry_width * itemsize
    return total, float(kv)


def random_state(spec: ModelSpec, context: int, device: torch.device, dtype: torch.dtype) -> KVState:
    gen = torch.Generator(device=device).manual_seed(1)
    layers = [torch.randn(context, spec.cache_heads, spec.cache_entry_width, generator=gen, device=device, dtype=dtype) * 0.5
              for _ in range(spec.num_layers)]
    return KVState(context, layers)


def time_engine(engine: Engine, spec: ModelSpec, context: int, tokens: int, device: torch.device, dtype: torch.dtype) -> float:
    """ms/token of a greedy decode after one warm-up decode (which captures the graphs)."""
    state = random_state(spec, context, device, dtype)
    params = SamplingParams(ignore_eos=True)
    for timed in (False, True):
        engine.inject(state)
        sync(device)
        res = engine.decode(3, tokens if timed else min(tokens, 8), params, lambda t: None)
        if timed:
            return res.timings["decode_ms"] / len(res.tokens)
    raise AssertionError


def run_engine_variants(args, spec: ModelSpec, weights, device, dtype, floors) -> list[Row]:
    rows: list[Row] = []
    max_ctx = max(args.contexts)
    windows = sorted({c + args.tokens + 16 for c in args.contexts})
    variants = ["speed-path", "graph", "graph[triton]"] + ([] if args.no_compile else ["compile+graph"]) + ["eager"]
    if device.type != "cuda":
        variants = ["static", "static[bmm]", "eager"]  # the graph's body without capture; eager
    if args.variants:
        variants = args.variants
    for variant in variants:
        model = engine = None
        layers.ATTENTION_IMPL["default"] = next((impl for impl in ("bmm", "triton") if variant.endswith(f"[{impl}]")), "sdpa")
        path = None
        try:
            model = build_model(spec, weights, max_ctx + args.tokens + 16, device, dtype)
            if variant == "speed-path":  # exactly what load_engine(device="cuda") turns on
                path = accelerate(model, compile_layers=not args.no_compile, compile_mode=args.compile_mode)
            elif variant.startswith("compile"):
                if not hasattr(model, "compile"):
                    raise RuntimeError(f"no compiled path for family {spec.family}")
                model.compile(mode=args.compile_mode, include_attention=variant == "compile+graph")
            engine = Engine(model, spec, device, max_ctx + args.tokens + 16, use_cuda_graph=variant != "eager", num_speculative_tokens=0)
            if engine.graph_step is not None:
                engine.graph_step.buckets = windows
                engine.graph_step.fallbacks = list(path.fallbacks) if path is not None else []
        except Exception as e:  # one variant failing must not sink the run
            for c in args.contexts:
                rows.append(Row(variant, c, 0, error=f"{type(e).__name__}: {e}"))
            traceback.print_exc(file=sys.stderr)
            continue
        for c in args.contexts:
            n = args.tokens if variant != "eager" else max(4, args.tokens // 4)
            try:
                ms = time_engine(engine, spec, c, n, device, dtype)
                gs = engine.graph_step
                extra = {"capture_error": gs.capture_error} if gs is not None and gs.capture_error else {}
                if path is not None:
                    extra["path"] = path.name + (f" (fell back: {len(path.fallbacks) - len(gs.fallbacks)} step(s))" if gs.fallbacks != path.fallbacks else "")
                failed = gs is not None and not gs.capture and device.type == "cuda"
                rows.append(Row(variant + (" (graph capture failed)" if failed else ""), c, n, ms, 100 * floors[c] / ms, extra=extra))
            except Exception as e:
                rows.append(Row(variant, c, n, error=f"{type(e).__name__}: {e}"))
                traceback.print_exc(file=sys.stderr)
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        del engine, model
        layers.ATTENTION_IMPL["default"] = "sdpa"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_speculative(args, spec: ModelSpec, weights, device, dtype, floors) -> list[Row]:
    """DeepSeek-V3 with its MTP layer: greedy speculative decode (eager steps), acceptance reported."""
    rows = []
    try:
        model = build_model(spec, weights, max(args.contexts) + args.tokens + 16, device, dtype)
        engine = Engine(model, spec, device, model.max_seq_len, use_cuda_graph=False, num_speculative_tokens=args.spec_tokens)
        for c in args.contexts:
            ms = time_engine(engine, spec, c, max(4, args.tokens // 4), device, dtype)
            rows.append(Row(f"mtp-spec(k={args.spec_tokens})", c, max(4, args.tokens // 4), ms, 100 * floors[c] / ms,
                            extra=dict(engine.last_spec_stats)))
    except Exception as e:
        rows.append(Row(f"mtp-spec(k={args.spec_tokens})", 0, 0, error=f"{type(e).__name__}: {e}"))
        traceback.print_exc(file=sys.stderr)
    return rows


def run_hf(args, cfg: dict, device, dtype, floors) -> list[Row]:
    """HF transformers generate, eager, batch 1, random weights of the same shapes."""
    rows = []
    try:
        import transformers

        hf_cfg = transformers.AutoConfig.for_model(**cfg)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    except Exception as e:
        return [Row("hf-generate", c, 0, error=f"{type(e).__name__}: {e}") for c in args.contexts]
    n = args.hf_tokens
    for c in args.contexts:
        try:
            ids = torch.randint(2, cfg["vocab_size"], (1, c), device=device)
            times = {}
            for new in (1, n + 1):
                kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
                with torch.no_grad():
                    model.generate(ids[:, :16], **kw)  # warm-up
                    sync(device)
                    t0 = time.perf_counter()
                    model.generate(ids, **kw)
                    sync(device)
                times[new] = time.perf_counter() - t0
            ms = (times[n + 1] - times[1]) / n * 1e3
            rows.append(Row("hf-generate", c, n, ms, 100 * floors[c] / ms))
        except Exception as e:
            rows.append(Row("hf-generate", c, n, error=f"{type(e).__name__}: {e}"))
            traceback.print_exc(file=sys.stderr)
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    del model
    gc.collect()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["llama3-8b", "dsv3-small"], default="llama3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths (default 1024 8192)")
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per timed decode (default 256)")
    ap.add_argument("--hf-tokens", type=int, default=None, help="tokens for HF generate (default 32)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="engine variants to run (speed-path, graph, graph[triton], graph[bmm], compile+graph, compile(no-attn)+graph, "
                         "compile(no-attn)+graph[triton], eager; on CPU 'static' = graph body)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--compile-mode", default=None, help='torch.compile mode, e.g. "max-autotune-no-cudagraphs"')
    ap.add_argument("--spec-tokens", type=int, default=2, help="MTP drafts per step (dsv3 models)")
    ap.add_argument("--bw-gib", type=float, default=None, help="buffer size of the bandwidth measurement (default 4 GiB)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        args.contexts = args.contexts or [32, 64]
        args.tokens = args.tokens or 8
        args.hf_tokens = args.hf_tokens or 4
        args.bw_gib = args.bw_gib or 0.01
    args.contexts = args.contexts or [1024, 8192]
    args.tokens = args.tokens or 256
    args.hf_tokens = args.hf_tokens or 32
    args.bw_gib = args.bw_gib or 4.0
    cfg = {"llama3-8b": TINY_LLAMA if args.tiny else LLAMA3_8B, "dsv3-small": TINY_DSV3 if args.tiny else DSV3_SMALL}[args.model]
    spec = spec_from_hf_config(cfg)
    report: dict = {"model": args.model + ("-tiny" if args.tiny else ""), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                    "torch": torch.__version__, "contexts": args.contexts, "rows": []}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    t0 = time.perf_counter()
    report["bandwidth"] = read_bandwidth(device, args.bw_gib)
    bw = report["bandwidth"]["sum_read_GBps"] * 1e9
    print(f"read bandwidth {bw / 1e9:.0f} GB/s (copy {report['bandwidth']['copy_rw_GBps']:.0f} GB/s)", file=sys.stderr, flush=True)
    weights = random_runtime_weights(spec, device, dtype)
    floors, report["floor"] = {}, {}
    for c in args.contexts:
        wb, kvb = step_read_bytes(spec, weights, c)
        floors[c] = (wb + kvb) / bw * 1e3
        report["floor"][str(c)] = {"weight_GB": wb / 1e9, "kv_GB": kvb / 1e9, "ms_per_token": floors[c],
                                   "weights_only_ms": wb / bw * 1e3}
    print(f"floor ms/token: {', '.join(f'{c}: {floors[c]:.3f}' for c in args.contexts)}", file=sys.stderr, flush=True)
    rows = run_engine_variants(args, spec, weights, device, dtype, floors)
    if spec.family == "deepseek_v3" and spec.num_mtp_layers:
        rows += run_speculative(args, spec, weights, device, dtype, floors)
    del weights
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_hf:
        rows += run_hf(args, cfg, device, dtype, floors)
    report["rows"] = [r.__dict__ for r in rows]
    report["seconds"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return report


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape  # variant names like graph[triton] are not markup tags
    from rich.table import Table

    bw = report["bandwidth"]
    title = (f"{report['model']} on {report.get('gpu', report['device'])} ({report['dtype']}, torch {report['torch']}): "
             f"read {bw['sum_read_GBps']:.0f} GB/s")
    table = Table(title=title)
    for col in ("variant", "context", "tokens", "ms/token", "floor ms", "% of floor", "note"):
        table.add_column(col)
    for r in report["rows"]:
        floor = report["floor"].get(str(r["context"]), {}).get("ms_per_token")
        note = r["error"] or (", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["extra"].items()))
        table.add_row(escape(r["variant"]), str(r["context"]), str(r["tokens"]),
                      f"{r['ms_per_token']:.3f}" if r["ms_per_token"] else "-", f"{floor:.3f}" if floor else "-",
                      f"{r['pct_of_floor']:.1f}%" if r["pct_of_floor"] else "-", escape(note[:80]))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
