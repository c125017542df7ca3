"""Batch-1 decode speed of the tilepd engine vs the HBM read floor and HF transformers, in one run.

On a GPU (the target: one NVIDIA H200):

    python bench/decode_speed.py                       # Llama-3-8B-shaped, contexts 1K and 8K
    python bench/decode_speed.py --model dsv3-small    # DeepSeek-V3-shaped MoE, 1 dense + 1 MoE layer + MTP
    python bench/decode_speed.py --json > decode.json  # machine-readable
    python bench/decode_speed.py --model dsv3-small --weights fp8 --no-hf   # block-scaled fp8 GEMV weights
    python bench/decode_speed.py --model glm5-small --no-hf --contexts 1024 8192 32768 131072   # DSA (GLM-5.1 shapes)
    python bench/decode_speed.py --sweep               # MLA kernel alone: tile configs at 8K/32K, us and GB/s
    python bench/decode_speed.py --model dsv3-small --mtp-forced-accept --contexts 1024 8192 32768 --json --out mtp.json
        # MTP only (k = --spec-tokens, default 1 3): plain vs verify step, tokens/s at forced full acceptance
    python bench/decode_speed.py --model dsv3-small --layers 61 --mtp-forced-accept   # the same at DeepSeek-V3's depth
    python bench/decode_speed.py --model glm-5.1 --weights fp8 --no-hf --variants speed-path --contexts 1024 32768 131072 200000
        # the served model: GLM-5.1 at its 78 layers (deepseek-v3 / deepseek-v3.2: 61); layers 4.. alias layer 3

The DeepSeek-family models run at their real depth (glm-5.1, deepseek-v3, deepseek-v3.2; --layers changes it);
dsv3-small / glm5-small are the explicit 2-layer shapes. On CUDA every row also carries, from a profiled decode over
the graph replays (bench/step_profile.py's profile_decode; --no-profile skips it): kernel launches per layer and per
step, the gap time per step (wall time minus the kernels' time) and the non-GEMV kernel time per layer.

Everything is built on the device with random bf16 weights: no download, no disk. Figures printed:
the measured read bandwidth (GB/s), the floor per token = (weight bytes a step reads + KV bytes at that
context) / read bandwidth, and ms/token + % of floor for each engine variant: `graph` (whole step in a
CUDA graph; attention through torch SDPA), `graph[triton]` / `graph[bmm]` (same, attention through the
split-KV Triton kernel / as two batched GEMVs), `speed-path` (what `load_engine(device="cuda")` uses:
compiled.accelerate = torch.compile'd layers around the Triton attention, in the graph),
`compile+graph` (per-layer torch.compile including SDPA attention, then the graph; skipped with --no-compile),
`speed-path[no-mla]` / `speed-path[no-mla-fused]` / `speed-path[no-moe-gemv]` / `speed-path[no-moe-route]` /
`speed-path[no-moe-fused]` (DeepSeek family: the speed path without the MLA kernel / without the fused attention
half-layer, mla_fused.py / without the grouped expert GEMV that reads bf16 experts in place, moe_triton.py / with the
torch router instead of the fused one, route_triton.py / with the MoE layers' norm, MoE and residual add as
moe_grouped's ~10 launches instead of moe_fused.py's 3), `speed-path[no-fused-gemv]`
(Llama family: without the GEMVs that fuse the norms, SiLU-mul and residual adds, gemv_triton.py),
`eager` (no graph, fewer tokens), and HF transformers `generate` (eager, batch 1, fewer tokens).
DeepSeek-family models also run `speed-path[no-mla]` (the speed path with MLA attention on the reference
path: SDPA / gather+matmul) beside `speed-path` (MLA through tilepd/engine/mla_attention.py's kernel), and
the two rows' greedy tokens are compared (`tokens_agree`: first 32 tokens, random bf16 weights, so rare
near-ties may legitimately differ). DSA floors count only what DSA reads: the weights, the index_topk
selected latent rows and the indexer keys it scores. Each variant is isolated: a failure is reported in
its row and the rest still run.

Variants `compile+graph` and `compile(no-attn)+graph` differ only in whether the cache-reading
attention is inside the compiled code. DeepSeek-family models also get MTP rows (run_speculative): the captured
verify+draft step with its own random drafts (`mtp-spec(k)`) and at forced full acceptance (`mtp-forced(k)`). `--device cpu --tiny` runs the same code on a tiny shape (the test suite does, so this script cannot rot).
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

from kit import CONFIGS, build_weights, emit_report, graph_time_us, model_spec, random_state, read_bandwidth, step_read_bytes, sync, time_engine
from tilepd.model_format.block_fp8 import BlockFp8
from tilepd.engine import layers, moe
from tilepd.engine.compiled import accelerate
from tilepd.engine.engine import Engine, build_model
from tilepd.model_format.model_spec import ModelSpec
from tilepd.engine.types import KVState, SamplingParams

# built at full size, 2 layers; the rest at their config's depth (--layers changes it)
SMALL_MODELS = ("dsv3-small", "glm5-small")


@dataclass
class Row:
    variant: str
    context: int
    tokens: int
    ms_per_token: float | None = None
    pct_of_floor: float | None = None
    error: str | None = None
    launches_per_layer: float | None = None  # from step_profile.profile_decode over graph replays (CUDA rows)
    launches_per_step: float | None = None
    gaps_us_per_step: float | None = None
    non_gemv_us_per_layer: float | None = None
    extra: dict = field(default_factory=dict)


def run_engine_variants(args, spec: ModelSpec, weights, device, dtype, floors) -> list[Row]:
    rows: list[Row] = []
    max_ctx = max(args.contexts)
    windows = sorted({c + args.tokens + 16 for c in args.contexts})
    variants = ["speed-path", "speed-path[no-fused-gemv]", "graph", "graph[triton]"] + ([] if args.no_compile else ["compile+graph"]) + ["eager"]
    if spec.family == "deepseek_v3":  # no compiled path; the MLA kernel, the expert GEMV and the router kernel on/off side by side
        variants = ["speed-path", "speed-path[no-mla]", "speed-path[no-moe-gemv]", "speed-path[no-moe-route]", "speed-path[no-moe-fused]", "graph",
                    "eager"]
    if device.type != "cuda":
        variants = ["static", "static[bmm]", "eager"]  # the graph's body without capture; eager
    if args.variants:
        variants = args.variants
    for variant in variants:
        model = engine = None
        layers.ATTENTION_IMPL["default"] = next((impl for impl in ("bmm", "triton") if variant.endswith(f"[{impl}]")), "sdpa")
        layers.ATTENTION_IMPL["mla"] = "reference"
        moe.EXPERT_IMPL["dense"] = "gather"
        moe.ROUTE_IMPL["router"] = "torch"
        moe.BLOCK_IMPL["moe"] = "torch"
        layers.GEMV_IMPL["dense"] = "torch"
        path = None
        try:
            model = build_model(spec, weights, max_ctx + args.tokens + 16, device, dtype)
            if variant == "speed-path":  # exactly what load_engine(device="cuda") turns on
                path = accelerate(model, compile_layers=not args.no_compile, compile_mode=args.compile_mode)
            elif variant in ("speed-path[no-mla]", "speed-path[no-moe-gemv]", "speed-path[no-moe-route]", "speed-path[no-moe-fused]",
                             "speed-path[no-fused-gemv]", "speed-path[no-mla-fused]"):
                path = accelerate(model, compile_layers=not args.no_compile, compile_mode=args.compile_mode,  # the same without one part
                                  mla_attention=variant != "speed-path[no-mla]", moe_gemv=variant != "speed-path[no-moe-gemv]",
                                  moe_route=variant != "speed-path[no-moe-route]", moe_fused=variant != "speed-path[no-moe-fused]",
                                  fused_gemv=variant != "speed-path[no-fused-gemv]", mla_fused=variant != "speed-path[no-mla-fused]")
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
                ms, toks = time_engine(engine, spec, c, n, device, dtype)
                gs = engine.graph_step
                extra = {"capture_error": gs.capture_error} if gs is not None and gs.capture_error else {}
                extra["first_tokens"] = toks[:32]
                if path is not None:
                    extra["path"] = path.name + (f" (fell back: {len(path.fallbacks) - len(gs.fallbacks)} step(s))" if gs.fallbacks != path.fallbacks else "")
                failed = gs is not None and not gs.capture and device.type == "cuda"
                row = Row(variant + (" (graph capture failed)" if failed else ""), c, n, ms, 100 * floors[c] / ms, extra=extra)
                if device.type == "cuda" and not args.no_profile:
                    _add_profile(row, engine, spec, c, args.profile_tokens, device, dtype)
                rows.append(row)
            except Exception as e:
                rows.append(Row(variant, c, n, error=f"{type(e).__name__}: {e}"))
                traceback.print_exc(file=sys.stderr)
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
        del engine, model
        layers.ATTENTION_IMPL["default"] = "sdpa"
        layers.ATTENTION_IMPL["mla"] = "reference"
        moe.EXPERT_IMPL["dense"] = "gather"
        moe.ROUTE_IMPL["router"] = "torch"
        moe.BLOCK_IMPL["moe"] = "torch"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _add_profile(row: Row, engine: Engine, spec: ModelSpec, context: int, tokens: int, device: torch.device, dtype: torch.dtype) -> None:
    """The row's launches, gaps and non-GEMV time from a profiled decode (step_profile.profile_decode); the profiled
    step's own wall time and its 12 largest kernels go to extra (the profiler slows the step a little)."""
    from step_profile import profile_decode

    try:
        p = profile_decode(engine, random_state(spec, context, device, dtype), tokens, spec.num_layers, top=12)
    except Exception as e:
        row.extra["profile_error"] = f"{type(e).__name__}: {e}"
        return
    row.launches_per_layer, row.launches_per_step = p["launches_per_layer"], p["launches_per_step"]
    row.gaps_us_per_step, row.non_gemv_us_per_layer = p["gaps_us_per_step"], p["non_gemv_us_per_layer"]
    row.extra["profile"] = {k: v for k, v in p.items() if k not in ("launches_per_layer", "launches_per_step", "gaps_us_per_step", "non_gemv_us_per_layer")}


def _mtp_step_profile(engine: Engine, state: KVState, spec: ModelSpec, tokens: int) -> dict:
    """The MTP step's kernels per step from a profiled decode at the step's current setting (step_profile.profile_decode
    per target step; its 20 largest kernels): where the step's time outside the verify and draft forwards goes."""
    from step_profile import profile_decode

    try:
        p = profile_decode(engine, state, tokens, spec.num_layers, top=20, per_target_step=True)
    except Exception as e:
        return {"profile_error": f"{type(e).__name__}: {e}"}
    return {"step_profile": {k: v for k, v in p.items() if k != "layers"}}


def _first_token_check(engine: Engine, model, state: KVState, first: int, window: int, device: torch.device) -> dict:
    """Why a forced MTP row's tokens may part from the plain decode's at once: the plain forward's logits for the
    first token (1 row) beside the verify forward's row 0 (2 rows, the same prefix), and that token's top-2 margin.
    A margin below the rows' difference is a near tie that the other kernel shapes may break the other way."""
    from verify_rows import row0

    spec = model.spec
    plain, verify = (row0(model, engine, state, spec, spec.num_layers, ids, window, device)[0] for ids in ([3], [3, first]))
    engine.inject(state)
    top2 = plain.topk(2).values
    return {"first_token_margin": float(top2[0] - top2[1]), "verify_row0_max_abs_diff": float((plain - verify).abs().max()),
            "verify_row0_argmax_agrees": bool(plain.argmax() == verify.argmax())}


def expert_share(spec: ModelSpec, rows: int) -> float:
    """Expected share of the routed experts that `rows` tokens read between them (each picks num_experts_per_tok
    of n_routed_experts; the bench's random router picks independently, so k+1 verify rows read ~k+1x the experts)."""
    return 1.0 - (1.0 - spec.num_experts_per_tok / spec.n_routed_experts) ** rows


def _nbytes(w) -> float:
    return float(w.nbytes() if isinstance(w, BlockFp8) else w.numel() * w.element_size())


def _part_bytes(spec: ModelSpec, weights: dict, names: list[str], rows: int) -> float:
    """Weight bytes `rows` tokens read through the named tensors (embedding: one row per token; experts: their share)."""
    total = 0.0
    for name in names:
        w = weights[name]
        if name == "embed":
            total += rows * w.shape[1] * w.element_size()
        elif name.endswith(("experts_w13", "experts_w2")):
            total += _nbytes(w) * expert_share(spec, rows)
        else:
            total += _nbytes(w)
    return total


def mtp_step_read_bytes(spec: ModelSpec, weights: dict, context: int, k: int) -> dict:
    """Bytes one MTP step must read: `verify` (the target on k+1 tokens: weights once, experts for k+1 rows,
    the context once; DSA: up to (k+1) x index_topk rows) and `draft` (the MTP layer on the k+1 catch-up rows,
    then k-1 single-row steps, each with the shared head and the MTP layer's context, as a prefill that ran
    the MTP layer ships it)."""
    main = [n for n in weights if not n.startswith("mtp.")]
    mtp = [n for n in weights if n.startswith("mtp.")] + ["lm_head"]
    itemsize = weights["embed"].element_size()

    def kv(layers: list[int], rows: int) -> float:
        if spec.is_dsa:
            sel = min(spec.index_topk * rows, context)
            return float(sum(sel * spec.cache_entry_width + (context * spec.index_head_dim if spec.has_indexer(i) else 0) for i in layers) * itemsize)
        return float(len(layers) * context * spec.cache_heads * spec.cache_entry_width * itemsize)

    mtp_layer = [spec.num_layers]
    verify = _part_bytes(spec, weights, main, k + 1) + kv(list(range(spec.num_layers)), k + 1)
    draft = _part_bytes(spec, weights, mtp, k + 1) + kv(mtp_layer, k + 1) + (k - 1) * (_part_bytes(spec, weights, mtp, 1) + kv(mtp_layer, 1))
    return {"verify": verify, "draft": draft}


def random_state_with_mtp(spec: ModelSpec, context: int, device: torch.device, dtype: torch.dtype) -> KVState:
    """random_state plus the MTP layers' KV (and indexer keys), as a prefill that ran the draft layer ships it:
    the MTP layer then attends over the whole context, as served."""
    base = random_state(spec, context, device, dtype)
    gen = torch.Generator(device=device).manual_seed(2)
    extra = [torch.randn(context, spec.cache_heads, spec.cache_entry_width, generator=gen, device=device, dtype=dtype) * 0.5
             for _ in range(spec.num_mtp_layers)]
    indexer = None
    if spec.is_dsa:
        indexer = base.indexer + [torch.randn(context, spec.index_head_dim, generator=gen, device=device, dtype=dtype)
                                  for _ in range(spec.num_mtp_layers)]
    return KVState(context, base.layers + extra, indexer)


def _decode_after_warmup(engine: Engine, state: KVState, tokens: int, device: torch.device):
    """A greedy decode of `tokens` tokens after a short warm-up decode (which captures the graphs)."""
    for n in (min(tokens, 8), tokens):
        engine.inject(state)
        sync(device)
        res = engine.decode(3, n, SamplingParams(ignore_eos=True), lambda t: None)
    return res


def run_speculative(args, spec: ModelSpec, weights, device, dtype, floors, bw: float) -> list[Row]:
    """DeepSeek-family MTP through the static verify+draft step (mtp.MtpStep; CUDA graphs on CUDA, the
    speed path's kernels), per context and per k in --spec-tokens:

    `mtp-spec(k)`: this model's own (random-weight) MTP drafts, acceptance as it comes (~0: the cost per step).
    `mtp-forced(k)`: drafts replaced by the no-MTP run's greedy tokens and every draft counted as accepted (the MTP
    layer still runs): tokens/s at full acceptance vs no-MTP, the step and the k+1-token verify forward against
    a plain step and a 1-token forward (each forward alone timed inside a graph), tokens/s for acceptance
    lengths 1..k+1 from the measured step time, and the byte floors of the verify and draft parts."""
    from tilepd.engine.mtp import mtp_step

    rows: list[Row] = []
    max_ctx = max(args.contexts)
    max_seq = max_ctx + args.tokens + 16
    ks = args.spec_tokens
    try:
        layers.ATTENTION_IMPL["mla"] = "reference"
        moe.EXPERT_IMPL["dense"] = "gather"
        moe.ROUTE_IMPL["router"] = "torch"
        moe.BLOCK_IMPL["moe"] = "torch"
        model = build_model(spec, weights, max_seq, device, dtype)
        path = accelerate(model, compile_layers=not args.no_compile, compile_mode=args.compile_mode) if device.type == "cuda" else None
        engine = Engine(model, spec, device, max_seq, use_cuda_graph=True, num_speculative_tokens=max(ks))
        engine.graph_step.buckets = sorted({c + args.tokens + 16 for c in args.contexts})
        engine.graph_step.fallbacks = list(path.fallbacks) if path is not None else []
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return [Row(f"mtp-spec(k={k})", c, 0, error=f"{type(e).__name__}: {e}") for k in ks for c in args.contexts]
    for c in args.contexts:
        try:
            state = random_state_with_mtp(spec, c, device, dtype)
            engine.num_speculative_tokens = 0
            base = _decode_after_warmup(engine, state, args.tokens, device)
            plain_ms = base.timings["decode_ms"] / len(base.tokens)
            window = engine.graph_step.window(c + args.tokens)

            # what the forced step verifies (padded past a short decode): a verify step's tokens, not one token t times,
            # whose rows would route alike and read fewer experts than a verify step reads
            verify_ids = [3] + base.tokens + list(range(4, 6 + max(ks)))

            def fwd_ms(t: int) -> float:
                ids = torch.tensor(verify_ids[:t], dtype=torch.long, device=device)
                pos = torch.arange(c, c + t, device=device)
                return graph_time_us(lambda: model.forward(ids, pos, window), device, reps=5) / 1e3

            def draft_ms(k: int) -> float:
                """The draft part alone: the MTP layer on k+1 catch-up rows (head on one), then k-1 single-row steps."""
                ids = torch.tensor(verify_ids[1 : k + 2], dtype=torch.long, device=device)
                pos = torch.arange(c, c + k + 1, device=device)
                hid = torch.randn(k + 1, spec.hidden_size, device=device, dtype=dtype)
                row = torch.zeros(1, dtype=torch.long, device=device)

                def chain() -> None:
                    _, h = model.mtp_forward(ids, hid, pos, window, head_rows=row)
                    h = h[:1]
                    for j in range(1, k):
                        _, h = model.mtp_forward(ids[:1], h, pos[:1] + j, window)

                return graph_time_us(chain, device, reps=5) / 1e3

            plain_fwd = fwd_ms(1)
        except Exception as e:
            rows += [Row(f"mtp-spec(k={k})", c, 0, error=f"{type(e).__name__}: {e}") for k in ks]
            traceback.print_exc(file=sys.stderr)
            continue
        for k in ks:
            for forced in (False, True):
                name = f"mtp-{'forced' if forced else 'spec'}(k={k})"
                try:
                    engine.num_speculative_tokens = k
                    engine._mtp_step = None  # free the previous k's graphs before capturing this one's
                    step = mtp_step(engine)
                    if forced:
                        step.set_oracle([0] * c + [3] + base.tokens, force=True)
                    res = _decode_after_warmup(engine, state, args.tokens, device)
                    st = dict(engine.last_mtp_stats)
                    ms = res.timings["decode_ms"] / len(res.tokens)
                    step_ms = res.timings["decode_ms"] / st["target_steps"]
                    parts = mtp_step_read_bytes(spec, weights, c, k)
                    floor_step = (parts["verify"] + parts["draft"]) / bw * 1e3
                    extra = {**st, "step_ms": step_ms, "step_vs_plain": step_ms / plain_ms, "plain_ms": plain_ms,
                             "step_pct_of_floor": 100 * floor_step / step_ms,
                             "graphs": len(step.graphs), "capture_error": step.capture_error}
                    if forced:
                        verify_fwd, draft_fwd = fwd_ms(k + 1), draft_ms(k)
                        wb, kvb = step_read_bytes(spec, weights, c)
                        agree = next((i for i, (a, b) in enumerate(zip(base.tokens, res.tokens)) if a != b), len(res.tokens))
                        extra.update({
                            "plain_tok_s": 1e3 / plain_ms, "tok_s": 1e3 / ms, "speedup": plain_ms / ms,
                            "plain_fwd_ms": plain_fwd, "verify_fwd_ms": verify_fwd, "verify_vs_plain": verify_fwd / plain_fwd,
                            "draft_fwd_ms": draft_fwd, "host_and_rest_ms": step_ms - verify_fwd - draft_fwd,
                            "verify_bytes_vs_plain": parts["verify"] / (wb + kvb), "draft_bytes_vs_plain": parts["draft"] / (wb + kvb),
                            "ideal_speedup": (k + 1) * (wb + kvb) / (parts["verify"] + parts["draft"]),
                            "match_rate": st["matched"] / st["drafted"] if st["drafted"] else 0.0, "tokens_agree": agree,
                            "tok_s_by_accept_len": {a: a * 1e3 / step_ms for a in range(1, k + 2)}})
                        try:
                            extra.update(_first_token_check(engine, model, state, base.tokens[0], window, device))
                        except Exception as e:
                            extra["first_token_check_error"] = f"{type(e).__name__}: {e}"
                        if device.type == "cuda" and not args.no_profile:
                            extra.update(_mtp_step_profile(engine, state, spec, args.profile_tokens))
                        step.set_oracle(None)
                    # % of floor per emitted token: the step's byte floor over the tokens it emitted on average
                    per_tok_floor = floor_step * st["target_steps"] / len(res.tokens)
                    rows.append(Row(name, c, len(res.tokens), ms, 100 * per_tok_floor / ms, extra={k2: v for k2, v in extra.items() if v is not None}))
                except Exception as e:
                    rows.append(Row(name, c, 0, error=f"{type(e).__name__}: {e}"))
                    traceback.print_exc(file=sys.stderr)
                print(f"  {_mtp_line(rows[-1].__dict__)}", file=sys.stderr, flush=True)
    del engine, model
    layers.ATTENTION_IMPL["default"] = "sdpa"
    layers.ATTENTION_IMPL["mla"] = "reference"
    moe.EXPERT_IMPL["dense"] = "gather"
    moe.ROUTE_IMPL["router"] = "torch"
    moe.BLOCK_IMPL["moe"] = "torch"
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


# --sweep: (block_n, block_h, num_warps) tiles x target program counts; num_stages stays TUNE's (env override).
SWEEP_TILES = [(bn, bh, nw) for bn in (32, 64) for bh in (16, 32, 64) for nw in (4, 8)]
SWEEP_PROGRAMS = (132, 264, 528)


def _sweep_cases(tiny: bool) -> list[dict]:
    """Kernel-alone cases: dsv3 dense MLA (128 heads) at 8K/32K, DSA top-2048 for GLM-5 (64 heads)."""
    if tiny:
        return [dict(name="dense 64 H=2", heads=2, rank=64, rope=16, context=64, topk=0),
                dict(name="sparse top-16 of 64 H=2", heads=2, rank=64, rope=16, context=64, topk=16)]
    return [dict(name=f"dense {c // 1024}K H=128", heads=128, rank=512, rope=64, context=c, topk=0) for c in (8192, 32768)] + [
        dict(name="sparse top-2048 of 32K H=64", heads=64, rank=512, rope=64, context=32768, topk=2048)]


def run_sweep(device: torch.device, tiny: bool, as_json: bool, out: Path | None) -> dict:
    """The MLA kernel alone over SWEEP_TILES x SWEEP_PROGRAMS per case, each checked against the fp32 reference
    (max_err) and timed inside a CUDA graph; GB/s counts the latent rows read (+ indices for DSA)."""
    from tilepd.engine import mla_attention as M
    from tilepd.engine.dsa import Selection, sparse_mla_attention
    from tilepd.engine.layers import attention_bias, cached_attention, length_mask

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    saved, saved_sparse = dict(M.TUNE), dict(M.TUNE_SPARSE)
    report: dict = {"sweep": True, "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "torch": torch.__version__, "tune_default": saved, "rows": []}
    tiles, programs = (SWEEP_TILES, SWEEP_PROGRAMS) if not tiny else ([(16, 16, 4)], (4,))
    for case in _sweep_cases(tiny):
        try:
            g = torch.Generator(device=device).manual_seed(0)
            h, r, L = case["heads"], case["rank"], case["context"]
            cache = torch.randn(L, 1, r + case["rope"], generator=g, device=device).to(dtype)
            q = torch.randn(1, h, r + case["rope"], generator=g, device=device).to(dtype)
            scale = 192 ** -0.5
            if case["topk"]:
                idx = torch.randperm(L, generator=g, device=device)[: case["topk"]][None]
                ok = torch.ones_like(idx, dtype=torch.bool)
                ok[:, -7:] = False  # a few masked slots, as a short context has
                sel = Selection(idx, ok)
                want = sparse_mla_attention(q.float(), cache.float(), r, sel, scale)
                kernel = lambda: M.mla_sparse_attention(q, cache, r, idx, ok, scale)  # noqa: E731
                reference = lambda: sparse_mla_attention(q, cache, r, sel, scale)  # noqa: E731
                nbytes = case["topk"] * (cache.shape[-1] * cache.element_size() + 9)
            else:
                pos = torch.tensor([L - 1], device=device)
                bias = attention_bias(length_mask(pos, L), h, dtype)
                zero = torch.zeros(1, dtype=torch.long, device=device)
                want = cached_attention(q.float(), cache.float(), cache[..., :r].float(), bias.float(), scale, impl="bmm")
                kernel = lambda: M.mla_dense_attention(q, cache, r, zero, pos, L, scale)  # noqa: E731
                reference = lambda: cached_attention(q, cache, cache[..., :r], bias, scale, impl="sdpa")  # noqa: E731
                nbytes = L * cache.shape[-1] * cache.element_size()
        except Exception as e:
            report["rows"].append({"case": case["name"], "config": "setup", "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc(file=sys.stderr)
            continue
        configs = [("reference", None)] + [(f"bn={bn} bh={bh} warps={nw} programs={pr}", (bn, bh, nw, pr)) for bn, bh, nw in tiles for pr in programs]
        for label, cfg in configs:
            row = {"case": case["name"], "config": label, "us": None, "GBps": None, "max_err": None, "error": None}
            try:
                if cfg is not None:
                    for tune in (M.TUNE, M.TUNE_SPARSE):  # the case decides which one the kernel reads
                        tune.update(block_n=cfg[0], block_h=cfg[1], num_warps=cfg[2], programs=cfg[3])
                fn = reference if cfg is None else kernel
                row["max_err"] = float((fn().float() - want).abs().max())
                row["us"] = graph_time_us(fn, device)
                row["GBps"] = nbytes / (row["us"] * 1e-6) / 1e9
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                M.TUNE.clear()
                M.TUNE.update(saved)
                M.TUNE_SPARSE.clear()
                M.TUNE_SPARSE.update(saved_sparse)
            report["rows"].append(row)
            print(f"  {row}", file=sys.stderr, flush=True)
        del cache, q, want
    report["rows"] += _sweep_experts(device, dtype, tiny)
    report["best"] = {}
    for case in {r["case"] for r in report["rows"]}:
        ok_rows = [r for r in report["rows"] if r["case"] == case and r.get("us") and not r["config"].startswith("reference") and r["max_err"] < 0.05]
        if ok_rows:
            report["best"][case] = min(ok_rows, key=lambda r: r["us"])["config"]
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print_sweep(report)
    return report


EXPERT_TILES = [(bk, nw, pr) for bk in (64, 128, 256) for nw in (4, 8) for pr in (264, 1056)]


def _sweep_experts(device: torch.device, dtype: torch.dtype, tiny: bool) -> list[dict]:
    """moe_triton.expert_gemv alone on DeepSeek-V3's routed experts (top-8 of 256: w13 then w2), per tile
    config, against the gather + einsum reference; GB/s counts the 8 selected experts' bytes."""
    from tilepd.engine import moe_triton

    rows: list[dict] = []
    e, h, mi, k = (8, 64, 32, 2) if tiny else (256, 7168, 2048, 8)
    saved = dict(moe_triton.TUNE)
    try:
        g = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(e, 2 * mi, h, generator=g, device=device, dtype=dtype) * h ** -0.5
        w2 = torch.randn(e, h, mi, generator=g, device=device, dtype=dtype) * mi ** -0.5
        ids = torch.randperm(e, generator=g, device=device)[:k]
        x = torch.randn(k, h, generator=g, device=device, dtype=dtype)
        a = torch.randn(k, mi, generator=g, device=device, dtype=dtype)
    except Exception as ex:
        return [{"case": "experts", "config": "setup", "error": f"{type(ex).__name__}: {ex}"}]
    nbytes = k * 3 * mi * h * w13.element_size()
    want = torch.cat([torch.einsum("rk,rnk->rn", x.float(), w13[ids].float()), torch.einsum("rk,rnk->rn", a.float(), w2[ids].float())], dim=1)

    def kernel() -> torch.Tensor:
        return torch.cat([moe_triton.expert_gemv(x, w13, ids), moe_triton.expert_gemv(a, w2, ids)], dim=1)

    def reference() -> torch.Tensor:  # moe.experts' gather path on the same rows
        return torch.cat([torch.einsum("rk,rnk->rn", x, w13[ids]), torch.einsum("rk,rnk->rn", a, w2[ids])], dim=1)

    name = f"experts top-{k} of {e} (w13+w2, h={h}, mi={mi})"
    tiles = EXPERT_TILES if not tiny else [(32, 4, 4)]
    for label, cfg in [("reference (gather+einsum)", None)] + [(f"bk={bk} warps={nw} programs={pr}", (bk, nw, pr)) for bk, nw, pr in tiles]:
        row = {"case": name, "config": label, "us": None, "GBps": None, "max_err": None, "error": None}
        try:
            if cfg is not None:
                moe_triton.TUNE.update(block_k=cfg[0], num_warps=cfg[1], programs=cfg[2])
            fn = reference if cfg is None else kernel
            row["max_err"] = float((fn().float() - want).abs().max())
            row["us"] = graph_time_us(fn, device)
            row["GBps"] = nbytes / (row["us"] * 1e-6) / 1e9
        except Exception as ex:
            row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        finally:
            moe_triton.TUNE.clear()
            moe_triton.TUNE.update(saved)
        rows.append(row)
        print(f"  {row}", file=sys.stderr, flush=True)
    return rows


def _print_sweep(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"MLA kernel alone on {report.get('gpu') or report['device']} (defaults: {report['tune_default']})")
    for col in ("case", "config", "us", "GB/s", "max_err", "note"):
        table.add_column(col)
    for r in report["rows"]:
        best = report["best"].get(r["case"]) == r["config"]
        table.add_row(r["case"], r["config"] + (" *best*" if best else ""), f"{r['us']:.1f}" if r.get("us") else "-",
                      f"{r['GBps']:.0f}" if r.get("GBps") else "-", f"{r['max_err']:.2e}" if r.get("max_err") is not None else "-",
                      (r.get("error") or "")[:60])
    Console(width=160).print(table)
    env = {"bn": "TILEPD_MLA_BLOCK_N", "bh": "TILEPD_MLA_BLOCK_H", "warps": "TILEPD_MLA_NUM_WARPS", "programs": "TILEPD_MLA_PROGRAMS",
           "bk": "TILEPD_MOE_BLOCK_K"}
    for case, cfg in sorted(report["best"].items()):
        prefix = "TILEPD_MOE" if case.startswith("experts") else "TILEPD_MLA"
        pairs = [kv.split("=") for kv in cfg.split()]
        print(f"best for {case}: " + " ".join(f"{env[k].replace('TILEPD_MLA', prefix)}={v}" for k, v in pairs))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(CONFIGS), default="llama3-8b")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: GEMV weights block-scaled e4m3 (as convert-weights --dtype fp8 stores them); no HF row")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="context lengths (default 1024 8192)")
    ap.add_argument("--tokens", type=int, default=None, help="generated tokens per timed decode (default 256)")
    ap.add_argument("--hf-tokens", type=int, default=None, help="tokens for HF generate (default 32)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="engine variants to run (speed-path, speed-path[no-mla], speed-path[no-mla-fused], speed-path[no-moe-gemv], speed-path[no-moe-route], speed-path[no-moe-fused], speed-path[no-fused-gemv], graph, graph[triton], graph[bmm], "
                         "compile+graph, compile(no-attn)+graph, "
                         "compile(no-attn)+graph[triton], eager; on CPU 'static' = graph body)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--compile-mode", default=None, help='torch.compile mode, e.g. "max-autotune-no-cudagraphs"')
    ap.add_argument("--spec-tokens", type=int, nargs="+", default=[1, 3], help="MTP drafts per step (DeepSeek-family models), one row set per k")
    ap.add_argument("--mtp-forced-accept", action="store_true",
                    help="only the MTP rows (DeepSeek family): plain vs verify step, tokens/s at forced full acceptance vs no-MTP")
    ap.add_argument("--layers", type=int, default=None,
                    help="DeepSeek family: this many main layers, layers past the first MoE layer aliasing its weights (default: the "
                         "model's depth: glm-5.1 78, deepseek-v3/v3.2 61; dsv3-small/glm5-small 2)")
    ap.add_argument("--no-mtp", action="store_true", help="DeepSeek family: skip the MTP rows")
    ap.add_argument("--no-profile", action="store_true", help="CUDA rows: skip the profiled decode (launches, gaps, non-GEMV time)")
    ap.add_argument("--profile-tokens", type=int, default=16, help="tokens of the profiled decode per row (default 16)")
    ap.add_argument("--bw-gib", type=float, default=None, help="buffer size of the bandwidth measurement (default 4 GiB)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--sweep", action="store_true", help="time the MLA kernel alone over tile configs (8K/32K dense, DSA top-k) and exit")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report to this file")
    args = ap.parse_args(argv)
    if args.sweep:
        return run_sweep(torch.device(args.device), args.tiny, args.json, args.out)
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
    cfg, spec, built = model_spec(args.model, args.tiny, args.layers)
    if args.mtp_forced_accept and args.no_mtp:
        raise SystemExit("--mtp-forced-accept runs only the MTP rows; --no-mtp skips them: choose one")
    if args.mtp_forced_accept and not (spec.family == "deepseek_v3" and spec.num_mtp_layers):
        raise SystemExit(f"--mtp-forced-accept needs a model with an MTP layer (dsv3-small, glm5-small), not {args.model}")
    report: dict = {"model": args.model + ("-tiny" if args.tiny else ""), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                    "weights": args.weights, "torch": torch.__version__, "contexts": args.contexts, "rows": []}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    t0 = time.perf_counter()
    report["bandwidth"] = read_bandwidth(device, args.bw_gib)
    bw = report["bandwidth"]["sum_read_GBps"] * 1e9
    print(f"read bandwidth {bw / 1e9:.0f} GB/s (copy {report['bandwidth']['copy_rw_GBps']:.0f} GB/s)", file=sys.stderr, flush=True)
    weights = build_weights(spec, built, device, dtype, args.weights)
    if args.weights == "fp8":
        args.no_hf = True  # HF would run other (bf16) weights
    if built.num_layers < spec.num_layers:
        report["layers"] = spec.num_layers
        report["built_layers"] = built.num_layers
        args.no_hf = True  # HF would need every layer's weights
    floors, report["floor"] = {}, {}
    for c in args.contexts:
        wb, kvb = step_read_bytes(spec, weights, c)
        floors[c] = (wb + kvb) / bw * 1e3
        report["floor"][str(c)] = {"weight_GB": wb / 1e9, "kv_GB": kvb / 1e9, "ms_per_token": floors[c],
                                   "weights_only_ms": wb / bw * 1e3}
    print(f"floor ms/token: {', '.join(f'{c}: {floors[c]:.3f}' for c in args.contexts)}", file=sys.stderr, flush=True)
    rows = [] if args.mtp_forced_accept else run_engine_variants(args, spec, weights, device, dtype, floors)
    if spec.family == "deepseek_v3" and spec.num_mtp_layers and not args.no_mtp:
        rows += run_speculative(args, spec, weights, device, dtype, floors, bw)
    if args.mtp_forced_accept:
        args.no_hf = True
    del weights
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_hf:
        rows += run_hf(args, cfg, device, dtype, floors)
    _tokens_agree(rows)
    report["rows"] = [r.__dict__ for r in rows]
    report["seconds"] = time.perf_counter() - t0
    emit_report(report, args, _print_table)
    return report


def _tokens_agree(rows: list[Row]) -> None:
    """Per context: how many leading greedy tokens each variant shares with the first variant's row."""
    first: dict[int, list[int]] = {}
    for r in rows:
        toks = r.extra.get("first_tokens")
        if toks is None:
            continue
        ref = first.setdefault(r.context, toks)
        if ref is not toks:
            r.extra["tokens_agree"] = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), min(len(ref), len(toks)))


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape  # variant names like graph[triton] are not markup tags
    from rich.table import Table

    bw = report["bandwidth"]
    title = (f"{report['model']} on {report.get('gpu', report['device'])} ({report['dtype']}, {report['weights']} weights, torch {report['torch']}): "
             f"read {bw['sum_read_GBps']:.0f} GB/s")
    table = Table(title=title)
    for col in ("variant", "context", "tokens", "ms/token", "floor ms", "% of floor", "launches/layer", "launches/step", "gaps us/step",
                "non-GEMV us/layer", "note"):
        table.add_column(col)

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in report["rows"]:
        floor = report["floor"].get(str(r["context"]), {}).get("ms_per_token")
        note = r["error"] or (", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["extra"].items()
                                        if k not in ("first_tokens", "profile")))
        table.add_row(escape(r["variant"]), str(r["context"]), str(r["tokens"]),
                      f"{r['ms_per_token']:.3f}" if r["ms_per_token"] else "-", f"{floor:.3f}" if floor else "-",
                      f"{r['pct_of_floor']:.1f}%" if r["pct_of_floor"] else "-", num(r.get("launches_per_layer"), ".1f"),
                      num(r.get("launches_per_step"), ".0f"), num(r.get("gaps_us_per_step"), ".0f"), num(r.get("non_gemv_us_per_layer"), ".1f"),
                      escape(note[:80]))
    Console(width=160).print(table)
    _print_mtp(report)


def _mtp_line(r: dict) -> str:
    """One plain-text line per MTP row (stderr while running; no rich needed on a bare GPU machine)."""
    if r["error"]:
        return f"{r['variant']} ctx={r['context']}: ERROR {r['error']}"
    e = r["extra"]
    line = (f"{r['variant']} ctx={r['context']}: {r['ms_per_token']:.3f} ms/token, step {e['step_ms']:.3f} ms "
            f"({e['step_vs_plain']:.2f}x plain {e['plain_ms']:.3f} ms, {e['step_pct_of_floor']:.1f}% of its floor), "
            f"acceptance {e['acceptance_rate']:.2f}")
    if "speedup" in e:
        by_len = " ".join(f"{float(v):.0f}" for v in e["tok_s_by_accept_len"].values())
        line += (f"; verify fwd {e['verify_vs_plain']:.2f}x plain fwd ({e['verify_fwd_ms']:.3f}/{e['plain_fwd_ms']:.3f} ms), "
                 f"draft {e['draft_fwd_ms']:.3f} ms, rest {e['host_and_rest_ms']:.3f} ms; "
                 f"{e['tok_s']:.0f} tok/s vs {e['plain_tok_s']:.0f} no-MTP = {e['speedup']:.2f}x (byte bound {e['ideal_speedup']:.2f}x); "
                 f"match {e['match_rate']:.2f}, tokens_agree {e['tokens_agree']} (first token's top-2 margin "
                 f"{e.get('first_token_margin', float('nan')):.3g}, verify row 0 off by {e.get('verify_row0_max_abs_diff', float('nan')):.3g}); tok/s at accept len 1..k+1: {by_len}")
    return line


def _print_mtp(report: dict) -> None:
    """The mtp-forced rows' ratios (issue 12's MTP targets: verify <= 1.25x a plain step at k=1; tokens/s at full
    acceptance >= 1.6x no-MTP at k=1, >= 2.5x at k=3) beside the byte-floor bound of this shape."""
    rows = [r for r in report["rows"] if r["variant"].startswith("mtp-forced") and not r["error"]]
    if not rows:
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="MTP at forced full acceptance (drafts = the no-MTP greedy tokens, all accepted; the MTP layer still runs)")
    for col in ("variant", "context", "plain ms", "verify/plain fwd", "step ms", "step/plain", "tok/s", "no-MTP tok/s", "speedup",
                "bytes bound", "step % floor", "match", "tok/s at accept len 1..k+1"):
        table.add_column(col)
    for r in rows:
        e = r["extra"]
        by_len = " ".join(f"{float(v):.0f}" for v in e["tok_s_by_accept_len"].values())
        table.add_row(escape(r["variant"]), str(r["context"]), f"{e['plain_ms']:.3f}", f"{e['verify_vs_plain']:.2f}x", f"{e['step_ms']:.3f}",
                      f"{e['step_vs_plain']:.2f}x", f"{e['tok_s']:.0f}", f"{e['plain_tok_s']:.0f}", f"{e['speedup']:.2f}x",
                      f"{e['ideal_speedup']:.2f}x", f"{e['step_pct_of_floor']:.1f}%", f"{e['match_rate']:.2f}", by_len)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
