"""One tensor-parallel rank's decode step timed alone on one GPU: GLM-5.1 FP8 at TP 8, collectives replaced by no-ops.

On one NVIDIA H200 (issue 24 part 3):

    python bench/tp_shard_step.py --json --out bench/results/tp-shard-step_glm51_fp8_tp8_h200.json   # 1K and 128K
    python bench/tp_shard_step.py --contexts 1024 32768 131072 200000 --tokens 128
    python bench/tp_shard_step.py --alias-layers        # layers 4..77 share layer 3's memory (less memory, see below)
    python bench/tp_shard_step.py --device cpu --tiny --json   # tiny shapes on CPU (the test suite runs it)

What is built: rank --rank's shard of GLM-5.1 at --tp ranks, as the decode server at tp_size=8 holds it: the
engine's own partitioning (tilepd.engine.tp.build_tp_model: 1/8 of the MLA heads, every routed and shared
expert's intermediate slice, vocab-parallel embedding and head; the latent cache, the DSA indexer and the router
replicated), over random weights that convert-weights' own code shards and quantises (weights.out_tensors,
weights.build, weights.fp8_build.block_and_scale_shape and build: each source part quantised to e4m3 with 128x128 block scales, then
sliced for the rank; the block each tensor gets is reported, and a column shard off a block boundary is refused
by plan() as convert-weights refuses it). All 78 layers: layers 0-3 (3 dense, the first MoE layer) are drawn,
layers 4.. copy layer 3's values into their own memory by default, so every layer reads its own bytes from HBM;
`--alias-layers` shares layer 3's tensors instead (decode_speed.py's `--layers`), which saves ~90 GB.

The collectives are NO-OPS (tp.NoCollectiveGroup): an all-reduce returns its input, the logits all-gather repeats
this rank's logits to the full vocab width. The figure is therefore the rank's own kernels and weight reads; the
2 all-reduces per layer, the embedding's all-reduce and the logits all-gather are not in it (bench/tp_decode.py
measures the real thing on a multi-GPU host). The step is what the decode server runs: engine_for ->
compiled.accelerate (MLA kernel, grouped expert GEMV, fp8 GEMV) inside a CUDA graph, timed as decode_speed.py
times it (a greedy decode of --tokens tokens after a warm-up decode that captures the graph).

Per context: ms/step, us/layer (ms/step over the layer count), the shard's floor = (its weights read once per
step: embedding one row, 8 of 256 routed expert slices, everything else whole; plus the replicated latent rows DSA
selects and all indexer keys at that context) / the measured read bandwidth (decode_speed.step_read_bytes), % of
floor, and issue 24's target beside it (<= 2.3 ms per step at 1K, <= 2.8 ms at 128K). On CUDA each row also
carries a profiled decode over the graph replays (step_profile.profile_decode: launches and gaps per layer, the 16
largest kernels; --no-profile skips it), so the shard's fixed cost can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import GLM51 as GLM51_WITH_MTP, emit_report, random_state, read_bandwidth, step_read_bytes, time_engine
from tilepd.dev.synthetic import hf_tensor_shapes, random_source
from tilepd.engine import pdl
from tilepd.engine.engine import engine_for
from tilepd.model_format.block_fp8 import DEFAULT_BLOCK, BlockFp8
from tilepd.model_format.model_spec import ModelSpec, spec_from_hf_config
from tilepd.engine.tp import NoCollectiveGroup, build_tp_model, local_spec
from tilepd.weights import fp8_build
from tilepd.weights.build import build_chunks, cast_chunk
from tilepd.weights.out_tensors import family_layout

# GLM-5.1 (transformers 5.19 GlmMoeDsaConfig defaults = huggingface.co/zai-org/GLM-5.1 config.json): decode_speed's
# per-layer shapes at the real depth, 3 dense layers first; no MTP layer (the plain decode step does not run it).
GLM51 = {**GLM51_WITH_MTP, "num_nextn_predict_layers": 0}  # decode_speed's shape table; the shard step has no MTP layer
# Tiny shapes that still split 8 ways on 128x128 fp8 blocks (every column shard 128 wide), 3 dense + 2 MoE layers.
TINY_GLM51 = {**GLM51, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 1024, "moe_intermediate_size": 1024,
              "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 64,
              "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16}
TARGET_MS = {1024: 2.3, 131072: 2.8}  # issue 24 part 3: ms per step of the TP8 shard, collectives not included


def shard_weights(spec: ModelSpec, device: torch.device, dtype: torch.dtype, rank: int, tp: int, fp8: bool) -> tuple[dict, dict[str, tuple[int, int]]]:
    """Rank `rank`'s runtime tensors as `convert-weights --tp tp [--dtype fp8]` writes them, random values, built
    one tensor at a time on `device`; and the fp8 block of each fp8 tensor (fp8_build.block_and_scale_shape's choice)."""
    shapes = hf_tensor_shapes(spec)
    get = random_source(shapes, device, dtype)
    get_fp8 = fp8_build.source_reader(lambda name: (get(name), None), DEFAULT_BLOCK)
    weights: dict = {}
    blocks: dict[str, tuple[int, int]] = {}
    for t in family_layout(spec, set()):
        if fp8 and fp8_build.stores_fp8(t, lambda p: False, True, False):
            block, scale_shape = fp8_build.block_and_scale_shape(t, lambda p: shapes[p], tp, DEFAULT_BLOCK)
            parts = list(fp8_build.build(t, get_fp8, block, rank, tp))
            w = BlockFp8(torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts]), block) if t.stacked else parts[0]
            if tuple(w.scale.shape) != tuple(scale_shape):
                raise RuntimeError(f"{t.name}: built scales {list(w.scale.shape)} differ from the plan's {list(scale_shape)}")
            weights[t.name], blocks[t.name] = _compact(w), block
        else:
            chunks = [cast_chunk(t, c, dtype)[0] for c in build_chunks(t, get, spec, rank, tp)]
            weights[t.name] = torch.stack(chunks) if t.stacked else _compact(chunks[0])
    return weights, blocks


def _compact(w):
    """A row shard is a view of its whole source (the vocab-parallel head: 1.9 GB held for 0.24 GB): own storage."""
    if isinstance(w, BlockFp8):
        return BlockFp8(_compact(w.weight), _compact(w.scale), w.block)
    return w.clone() if w.untyped_storage().nbytes() > w.numel() * w.element_size() else w


def _nbytes(w) -> int:
    return w.nbytes() if isinstance(w, BlockFp8) else w.numel() * w.element_size()


def _copy(w):
    return BlockFp8(w.weight.clone(), w.scale.clone(), w.block) if isinstance(w, BlockFp8) else w.clone()


def deepen(weights: dict, built: int, layers: int, alias: bool) -> None:
    """Layers built..layers-1 from layer built-1 (an MoE layer): their own copies of its values, or aliases."""
    src = f"layers.{built - 1}."
    names = [n for n in weights if n.startswith(src)]
    for i in range(built, layers):
        for n in names:
            weights[f"layers.{i}." + n.removeprefix(src)] = weights[n] if alias else _copy(weights[n])


def fp8_report(blocks: dict[str, tuple[int, int]], weights: dict, block: tuple[int, int] = DEFAULT_BLOCK) -> dict:
    """Which fp8 tensors kept whole 128x128 blocks, which fell back to per-row scales (a row shard off a block
    boundary) and which have a partial edge block (a dimension not a multiple of the block, as the checkpoint has)."""
    leaf = lambda n: n.split(".", 2)[-1] if n.startswith("layers.") else n  # noqa: E731
    per_row = sorted({leaf(n) for n, b in blocks.items() if b != block})
    edge = sorted({leaf(n) for n in blocks if any(d % b for d, b in zip(weights[n].shape[-2:], block))})
    return {"block": list(block), "tensors_built": len(blocks), "per_row_scales": per_row, "partial_edge_blocks": edge}


def kv_bytes_allocated(spec: ModelSpec, max_seq: int, itemsize: int) -> int:
    """The model's latent caches and indexer-key caches for max_seq tokens (one copy)."""
    per_token = sum(spec.cache_entry_width + (spec.index_head_dim if spec.has_indexer(i) else 0) for i in range(spec.num_layers))
    return per_token * max_seq * itemsize


def check_fits(device: torch.device, need: int, what: str) -> None:
    """Refuse up front (naming the figures) what would run out of device memory half-way through."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # cached by torch (the bandwidth probe's)
    if need > free:
        raise SystemExit(f"tp_shard_step: {what} needs {need / 1e9:.1f} GB more on {torch.cuda.get_device_name(device)}, "
                         f"{free / 1e9:.1f} of {total / 1e9:.1f} GB free: use --alias-layers, fewer/shorter --contexts or --layers")


def logits_width(model, device: torch.device) -> int:
    """Width of one eager step's logits (the no-op gather must give the full vocab, as the real one does)."""
    with torch.no_grad():  # not inference_mode: a buffer the model made lazily here must stay writable by the engine
        logits, _ = model.forward(torch.tensor([3], device=device), torch.tensor([0], device=device), min(16, model.max_seq_len))
    return int(logits.shape[-1])


def pdl_form(tp: int) -> dict[str, int]:
    """The PDL switches the rank's step launches with (pdl.shard_form on a rank of more than one: SHARD_FORM where the
    environment leaves a switch unset), so a result says which form it timed."""
    with pdl.shard_form(tp > 1):
        return {key: int(pdl.SWITCH[key]) for key in pdl.SHARD_FORM}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test; still 8-way on 128x128 fp8 blocks)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size the shard is cut for")
    ap.add_argument("--rank", type=int, default=0, help="which rank's shard (all have the same shapes)")
    ap.add_argument("--layers", type=int, default=None, help="main layers (default: the model's, 78)")
    ap.add_argument("--weights", choices=["fp8", "bf16"], default="fp8", help="fp8: convert-weights --dtype fp8's block-scaled e4m3")
    ap.add_argument("--alias-layers", action="store_true", help="layers 4.. share layer 3's tensors instead of their own copies")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="tokens already in the cache (default 1024 131072)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens decoded in each timed run (default 256; tiny 8)")
    ap.add_argument("--bw-gib", type=float, default=None, help="size of the read-bandwidth probe (default 4 GiB)")
    ap.add_argument("--no-graph", action="store_true", help="eager steps (no CUDA graph)")
    ap.add_argument("--plain-graph", action="store_true", help="CUDA graph of the plain step (no speed path)")
    ap.add_argument("--no-profile", action="store_true", help="CUDA rows: skip the profiled decode (launches, gaps, the largest kernels)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON report to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tp_shard_step: --device cuda but torch sees no GPU (use --device cpu --tiny)")
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny batch-1 GEMVs only lose from threads on shared cores
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    contexts = args.contexts or ([32, 64] if args.tiny else [1024, 131072])
    tokens = args.tokens or (8 if args.tiny else 256)
    bw_gib = args.bw_gib or (0.01 if args.tiny else 4.0 if device.type == "cuda" else 0.25)
    cfg = dict(TINY_GLM51 if args.tiny else GLM51)
    if args.layers:
        if args.layers <= cfg["first_k_dense_replace"]:
            raise SystemExit(f"tp_shard_step: --layers {args.layers} leaves no MoE layer (first_k_dense_replace={cfg['first_k_dense_replace']})")
        cfg["num_hidden_layers"] = args.layers
    if not 0 <= args.rank < args.tp:
        raise SystemExit(f"tp_shard_step: --rank {args.rank} is not a rank of --tp {args.tp}")
    spec = spec_from_hf_config(cfg)
    shard_spec = local_spec(spec, args.tp)  # refuses a TP size the shapes cannot split, naming the field
    t0 = time.perf_counter()

    def phase(what: str) -> None:  # a run cut off by a time limit shows where it was
        print(f"  [{time.perf_counter() - t0:6.1f}s] {what}", file=sys.stderr, flush=True)

    report: dict = {
        "model": "glm-5.1" + ("-tiny" if args.tiny else ""), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "weights": args.weights, "torch": torch.__version__, "tp": args.tp, "rank": args.rank, "layers": spec.num_layers,
        "layer_weights": "aliased (layers 4.. share layer 3's tensors)" if args.alias_layers else "own copy per layer",
        "collectives": "NO-OPS (tp.NoCollectiveGroup): all-reduce returns its input, the logits all-gather repeats this rank's "
                       "logits to the full vocab width; no collective time is in these figures",
        "heads": {"model": spec.num_heads, "shard": shard_spec.num_heads},
        "pdl": pdl_form(args.tp),
        "contexts": contexts, "tokens": tokens, "rows": [],
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    report["bandwidth"] = read_bandwidth(device, bw_gib)
    bw = report["bandwidth"]["sum_read_GBps"] * 1e9
    phase(f"read bandwidth {bw / 1e9:.0f} GB/s")

    built_n = min(spec.num_layers, spec.first_k_dense_replace + 1)
    built = spec_from_hf_config({**cfg, "num_hidden_layers": built_n})
    weights, blocks = shard_weights(built, device, dtype, args.rank, args.tp, fp8=args.weights == "fp8")
    last = f"layers.{built_n - 1}."
    layer_bytes = sum(_nbytes(w) for n, w in weights.items() if n.startswith(last))
    phase(f"layers 0-{built_n - 1} of rank {args.rank}'s shard built ({sum(_nbytes(w) for w in weights.values()) / 1e9:.2f} GB; "
          f"one MoE layer {layer_bytes / 1e9:.3f} GB)")
    max_seq = max(contexts) + tokens + 16
    kv = kv_bytes_allocated(shard_spec, max_seq, torch.tensor([], dtype=dtype).element_size())
    more = (0 if args.alias_layers else (spec.num_layers - built_n) * layer_bytes) + 2 * kv + (4 << 30)  # caches + one injected state + slack
    check_fits(device, more, f"{spec.num_layers - built_n} more layers{' (aliased)' if args.alias_layers else ''}, "
                             f"{kv / 1e9:.1f} GB of caches for {max_seq} tokens and as much for the injected state")
    deepen(weights, built_n, spec.num_layers, args.alias_layers)
    unique = {id(w): w for w in weights.values()}
    report["shard_GB"] = sum(_nbytes(w) for w in unique.values()) / 1e9
    report["fp8"] = fp8_report(blocks, weights) if blocks else None
    phase(f"{spec.num_layers} layers: {report['shard_GB']:.1f} GB of weights on the device")

    tp = NoCollectiveGroup(args.rank, args.tp)
    model = build_tp_model(spec, weights, max_seq, device, dtype, tp)
    report["vocab"] = {"model": spec.vocab_size, "shard_rows": int(weights["lm_head"].shape[0]), "logits_width": logits_width(model, device)}
    report["shard_spec"] = {"num_heads": model.spec.num_heads, "moe_intermediate_rows": int(weights[last + "experts_w2"].shape[-1])}
    engine = engine_for(model, spec, device, max_seq, use_cuda_graph=not args.no_graph, num_speculative_tokens=0,
                        speed_path=not args.plain_graph)
    gs = engine.graph_step
    planned_fallbacks = len(gs.fallbacks) if gs is not None else 0
    if gs is not None:
        gs.buckets = sorted({c + tokens + 16 for c in contexts})  # one graph per context, its window just past it
    phase(f"model built, path {engine.speed_path}")
    for c in contexts:
        wb, kvb = step_read_bytes(model.spec, weights, c)
        floor_ms = (wb + kvb) / bw * 1e3
        row: dict = {"context": c, "weight_GB": wb / 1e9, "kv_GB": kvb / 1e9, "floor_ms": floor_ms, "target_ms": TARGET_MS.get(c)}
        try:
            ms, _ = time_engine(engine, model.spec, c, tokens, device, dtype)
        except Exception as e:  # noqa: BLE001 - one context failing (out of memory) must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            row.update({"ms_per_step": ms, "us_per_layer": ms * 1e3 / spec.num_layers, "pct_of_floor": 100 * floor_ms / ms,
                        "within_target": None if row["target_ms"] is None else ms <= row["target_ms"]})
            if device.type == "cuda" and not args.no_profile:  # where the shard's ~95 us a layer goes, kernel by kernel
                from step_profile import profile_decode

                try:
                    row["profile"] = profile_decode(engine, random_state(model.spec, c, device, dtype), 16, spec.num_layers, top=16)
                except Exception as e:  # noqa: BLE001 - the timing stands without its profile
                    row["profile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if gs is None:
            row["graph"] = "none (eager)"
        elif not gs.capture:
            row["graph"] = "static body, not captured" + (f" (capture failed: {gs.capture_error[:160]})" if gs.capture_error else " (CPU)")
        else:
            used = planned_fallbacks - len(gs.fallbacks)
            row["graph"] = "captured" + (f" after {used} speed-path fallback(s): {gs.capture_error[:160]}" if used else "")
        row["path"] = engine.speed_path
        report["rows"].append(row)
        phase(f"context {c}: " + (row.get("error") or f"{row['ms_per_step']:.3f} ms/step, floor {floor_ms:.3f} ms, "
                                  f"{row['pct_of_floor']:.1f}%, graph {row['graph']}"))
    if device.type == "cuda":
        report["peak_allocated_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    report["seconds"] = time.perf_counter() - t0
    emit_report(report, args, print_report)
    return report


def print_report(r: dict) -> None:
    """Plain text (no rich: a bare GPU machine may not have it)."""
    f = r["fp8"]
    fp8 = (f"fp8 {f['block'][0]}x{f['block'][1]} blocks, per-row scales: {', '.join(f['per_row_scales']) or 'none'}" if f else "bf16")
    print(f"{r['model']} rank {r['rank']} of TP {r['tp']}: {r['layers']} layers ({r['layer_weights']}), {fp8}, "
          f"{r['heads']['shard']} of {r['heads']['model']} heads, vocab rows {r['vocab']['shard_rows']} of {r['vocab']['model']}, "
          f"{r['shard_GB']:.1f} GB on {r.get('gpu', r['device'])}, read {r['bandwidth']['sum_read_GBps']:.0f} GB/s")
    print(f"COLLECTIVES: {r['collectives']}")
    print(f"PDL (the rank's shard form, pdl.shard_form): {r['pdl']}")
    print(f"{'context':>8} {'ms/step':>8} {'us/layer':>8} {'floor ms':>8} {'% floor':>8} {'target ms':>9}  graph / path")
    for row in r["rows"]:
        target = f"{row['target_ms']:.1f}" if row["target_ms"] else "-"
        if "error" in row:
            print(f"{row['context']:>8} error: {row['error']}")
            continue
        mark = "" if row["within_target"] is None else (" met" if row["within_target"] else " MISSED")
        print(f"{row['context']:>8} {row['ms_per_step']:8.3f} {row['us_per_layer']:8.1f} {row['floor_ms']:8.3f} "
              f"{row['pct_of_floor']:7.1f}% {target:>9}{mark}  {row['graph']} / {row['path']}")
        if "profile" in row:
            from step_profile import profile_line

            print(f"{'':>8} profiled: {profile_line(row['profile'])}")


if __name__ == "__main__":
    main()
