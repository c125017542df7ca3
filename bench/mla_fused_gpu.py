"""The fused attention half-layer's own kernels (mla_fused_triton.py, mla_attention.py's split kernel) on the GPU.

1. parity at GLM-5.1 and DeepSeek-V3 shapes, bf16, T = 1 and 2, outputs allocated over NaN-poisoned memory:
   `prepare` (W_UK absorb + q RoPE, the latent's norm + RoPE into the cache, the indexer key, the indexer's head
   weights) and `merge_uv` (split-KV merge + W_UV) against the model's own ops (prepare_reference /
   merge_uv_reference), and the split MLA kernel + merge (dense span and DSA selection) against
   dsa.sparse_mla_attention in float32: max relative error;
2. time per call inside a CUDA graph (kit.graph_time_us) for each tile configuration of TUNE (--sweep), and the
   bytes each must read (W_UK / W_UV: the floor of the absorb and of the merge), so the defaults can be set from a
   measurement;
3. the attention itself (split kernel + merge_uv, as the step runs them) at short windows, per tile configuration
   and split policy (mla_attention.TUNE / TUNE_SPARSE), with the caches rotated over more than the L2 so each
   call reads its rows from HBM as a layer of the step does; the DSA scoring path past index_topk (prepare with
   head weights, the indexer's scores, the top-k, the sparse attention) at 32K, 128K and 200K.
Exits 1 when an error exceeds --max-rel. --best-env FILE writes the picked tiles as shell exports.

    python bench/mla_fused_gpu.py --out bench/results/mla-fused-gpu_h200.json
    python bench/mla_fused_gpu.py --device cpu --tiny      # CPU smoke test under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import graph_time_us, read_bandwidth
from sweep_check import tune_override
from tilepd.engine import mla_attention as A
from tilepd.engine import mla_fused_triton as M
from tilepd.engine.rope import rope_table

GLM51 = {"name": "glm-5.1", "heads": 64, "nope": 192, "rope": 64, "rank": 512, "v": 256, "hidden": 6144, "idx_heads": 32, "idx_d": 128,
         "topk": 2048}
DSV3 = {"name": "deepseek-v3", "heads": 128, "nope": 128, "rope": 64, "rank": 512, "v": 128, "hidden": 7168, "idx_heads": 0, "idx_d": 0,
        "topk": 0}
TINY = {"name": "tiny", "heads": 2, "nope": 32, "rope": 16, "rank": 64, "v": 32, "hidden": 96, "idx_heads": 4, "idx_d": 32, "topk": 64}
PREPARE_SWEEP = {"block_c": (32, 64, 128), "block_d": (32, 64), "prep_unroll": (0, 1), "prep_warps": (4, 8)}
MERGE_SWEEP = {"block_v": (32, 64, 128), "chunk_c": (256, 512), "merge_unroll": (0, 1), "merge_warps": (4, 8)}
# the split kernel's tiles (block_h, block_n, num_warps, num_stages) and split policies (programs, min_blocks): the two
# defaults before (DSA's and dense MLA's), and the tiles ptxas fits without spilling at rank 512 (sm_90 resource
# report, Triton 3.9 on the CPU machine: 16/32/4 and 32/64/4 spill 16 and 1136 bytes a thread; 64-head programs spill)
ATTN_TILES = [(16, 32, 4, 2), (32, 64, 4, 2), (16, 16, 4, 1), (16, 16, 8, 1), (16, 32, 8, 1), (16, 32, 8, 2), (32, 16, 4, 1),
              (32, 16, 8, 1), (32, 32, 8, 1), (32, 32, 8, 2)]
ATTN_POLICIES = [(132, 4), (132, 1), (264, 1), (396, 1)]
TINY_TILES, TINY_POLICIES = [(16, 16, 4, 1)], [(8, 1)]
TILE_KEYS = ("block_h", "block_n", "num_warps", "num_stages", "programs", "min_blocks")  # a split tile's tune keys
SCORING_CONTEXTS = (32768, 131072, 200000)


def cache_copies(rows: int, row_bytes: int, dev: torch.device, most: int) -> int:
    """How many copies of a `rows`-row cache to rotate over so each call reads its rows from HBM (~150 MB, past the
    L2), at most `most`; one off CUDA."""
    return 1 if dev.type != "cuda" else max(1, min(most, -(-150_000_000 // (rows * row_bytes))))


def poison(dev: torch.device) -> None:
    """Fill the caching allocator's free memory with NaN, so a kernel's torch.empty outputs start poisoned."""
    if dev.type == "cuda":
        torch.empty(64 << 20, dtype=torch.float32, device=dev).fill_(float("nan"))


def inputs(shape: dict, t: int, splits: int, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*size: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=dev) * scale).to(dt)

    h, nope, rope, rank, slots = shape["heads"], shape["nope"], shape["rope"], shape["rank"], 4096
    table = rope_table(rope, 10000.0, None, 8192, slots, dev, dtype, interleaved=True)
    positions = torch.arange(slots - 10 - t, slots - 10, device=dev)
    cs = table.index_select(0, positions)
    idx_d, hid = max(shape["idx_d"], 16), shape["hidden"]
    return {
        "q": rnd(t, h * (nope + rope)), "kv": rnd(t, rank + rope), "w_uk": rnd(h, nope, rank, scale=0.05), "kv_norm": 1 + rnd(rank, scale=0.1),
        "cs": cs, "positions": positions, "cache": rnd(slots, 1, rank + rope), "kx": rnd(t, idx_d),
        "kn": 1 + rnd(idx_d, scale=0.1), "kb": rnd(idx_d, scale=0.1), "icache": rnd(slots, idx_d),
        "x": rnd(t, hid), "xn": 1 + rnd(hid, scale=0.1), "wp": rnd(max(shape["idx_heads"], 1), hid, scale=0.02, dt=torch.float32),
        "part": rnd(t, h, splits, rank, dt=torch.float32), "lse": rnd(t, h, splits, scale=3.0, dt=torch.float32),
        "w_uv": rnd(h, shape["v"], rank, scale=0.05),
    }


def run_prepare(a: dict, shape: dict, weights: bool, cache: torch.Tensor, icache: torch.Tensor, ref: bool = False) -> tuple:
    fn = M.prepare_reference if ref else M.prepare
    index = (a["kx"], a["kn"], a["kb"], a["cs"], icache, True) if shape["idx_d"] else None
    head_weights = (a["x"], a["xn"], 1e-5, a["wp"]) if weights and index else None
    return fn(a["q"], a["kv"], a["w_uk"], a["kv_norm"], 1e-6, a["cs"], a["positions"], cache, shape["rank"], shape["rope"], True, index, head_weights)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a.float()).all():
        return float("inf")
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def attention(q: torch.Tensor, cache: torch.Tensor, shape: dict, w_uv: torch.Tensor, length: int, sel: tuple | None,
              span: tuple | None) -> torch.Tensor:
    """The step's attention: the split kernel (DSA selection or dense span) and merge + W_UV."""
    rank, scale = shape["rank"], (shape["nope"] + shape["rope"]) ** -0.5
    if sel is not None:
        part, lse = A.split_partials(q, cache, rank, scale, length, idx=sel[0], ok=sel[1])
    else:  # a DSA model's span takes DSA's tiles, as mla_fused does
        part, lse = A.split_partials(q, cache, rank, scale, length, lo=span[0], hi=span[1], tune=A.TUNE_SPARSE if shape["idx_d"] else None)
    return M.merge_uv(part, lse, w_uv, q.dtype, cache.dtype)


def attention_case(shape: dict, t: int, length: int, cache_rows: int, mode: str, dev: torch.device, dtype: torch.dtype,
                   copies: int = 1, seed: int = 1) -> dict:
    """Inputs of one attention call: q, `copies` caches (to rotate past the L2), the selection or span."""
    g = torch.Generator(device=dev).manual_seed(seed)
    h, rank, rope = shape["heads"], shape["rank"], shape["rope"]
    caches = [torch.randn(cache_rows, 1, rank + rope, generator=g, device=dev).to(dtype) for _ in range(copies)]
    q = (torch.randn(t, h, rank + rope, generator=g, device=dev) * 0.3).to(dtype)
    w_uv = (torch.randn(h, shape["v"], rank, generator=g, device=dev) * 0.05).to(dtype)
    pos = torch.arange(length - t, length, device=dev)
    valid = torch.arange(length, device=dev)[None, :] <= pos[:, None]
    if mode == "sparse-all":  # every causal slot of the window, by index (the fused path's DSA selection at 1K before)
        sel, span = (torch.arange(length, device=dev).expand(t, length).contiguous(), valid.contiguous()), None
    elif mode == "sparse":  # index_topk slots of a longer cache, random (DSA past index_topk)
        idx = torch.stack([torch.randperm(cache_rows, generator=g, device=dev)[:length] for _ in range(t)])
        sel, span = (idx, torch.ones(t, length, dtype=torch.bool, device=dev)), None
    else:  # dense span 0..position
        sel, span = None, (torch.zeros(t, dtype=torch.long, device=dev), pos)
    return {"q": q, "caches": caches, "w_uv": w_uv, "length": length, "sel": sel, "span": span, "valid": valid}


def attention_reference(c: dict, shape: dict) -> torch.Tensor:
    from tilepd.engine.dsa import Selection, sparse_mla_attention

    t, length = c["q"].shape[0], c["length"]
    idx, ok = c["sel"] if c["sel"] is not None else (torch.arange(length, device=c["q"].device).expand(t, length), c["valid"])
    lat = sparse_mla_attention(c["q"].float(), c["caches"][0].float(), shape["rank"], Selection(idx, ok),
                               (shape["nope"] + shape["rope"]) ** -0.5)
    return torch.einsum("thc,hvc->thv", lat, c["w_uv"].float()).reshape(t, -1)


def parity(shape: dict, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    for t in (1, 2):
        a = inputs(shape, t, 16, dev, dtype, seed=10 + t)
        c1, c2, i1, i2 = a["cache"].clone(), a["cache"].clone(), a["icache"].clone(), a["icache"].clone()
        poison(dev)
        q1, w1 = run_prepare(a, shape, True, c1, i1)
        q2, w2 = run_prepare(a, shape, True, c2, i2, ref=True)
        poison(dev)
        m1 = M.merge_uv(a["part"], a["lse"], a["w_uv"], dtype, dtype)
        m2 = M.merge_uv_reference(a["part"], a["lse"], a["w_uv"], dtype, dtype)
        row = {"shape": shape["name"], "T": t, "q": rel(q1, q2), "cache": rel(c1, c2), "merge_uv": rel(m1, m2)}
        if shape["idx_d"]:
            row.update(index_cache=rel(i1, i2), head_weights=rel(w1, w2))
        small = shape["name"] == "tiny"
        for mode, length, rows_ in (("dense", 200 if small else 1024, 200 if small else 1024),
                                    ("sparse", 48 if small else 2048, 300 if small else 32768)):
            c = attention_case(shape, t, length, rows_, mode, dev, dtype, seed=20 + t)
            poison(dev)
            got = attention(c["q"], c["caches"][0], shape, c["w_uv"], length, c["sel"], c["span"])
            row[f"attention_{mode}"] = rel(got, attention_reference(c, shape))
        rows.append(row)
    return rows


def sweep(table: dict, base: dict, time_fn) -> list[dict]:  # noqa: ANN001 - a timing closure
    out = []
    keys = list(table)
    for values in itertools.product(*(table[k] for k in keys)):
        cfg = dict(zip(keys, values))
        M.TUNE.update({**base, **cfg})
        try:
            out.append({**cfg, "us": round(time_fn(), 2)})
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot compile or run is reported, the others still run
            out.append({**cfg, "error": repr(e)[:200]})
    M.TUNE.update(base)
    return sorted(out, key=lambda r: r.get("us", float("inf")))


def time_attention(c: dict, shape: dict, dev: torch.device, reps: int) -> float:
    turn = iter(itertools.cycle(c["caches"]))  # one graph of at least one call per cache copy: rows come from HBM
    return graph_time_us(lambda: attention(c["q"], next(turn), shape, c["w_uv"], c["length"], c["sel"], c["span"]), dev,
                         max(reps, len(c["caches"])))


def split_tiles(tiles: list[tuple], policies: list[tuple]) -> list[dict]:
    """The split kernel's configurations: tiles (block_h, block_n, num_warps, num_stages) crossed with policies
    (programs, min_blocks), as tune dicts (TILE_KEYS)."""
    return [dict(zip(TILE_KEYS, tile + policy)) for tile, policy in itertools.product(tiles, policies)]


def attention_sweep(cases: dict, shapes: dict, dev: torch.device, combos: list[dict], reps: int) -> list[dict]:
    """Each configuration (split_tiles) on every case, timed as the step runs it; the tune dict the case reads (DSA
    models' TUNE_SPARSE, dense MLA's TUNE) holds it for that case only."""
    out = []
    for cfg in combos:
        row = dict(cfg)
        for name, c in cases.items():
            with tune_override(A.TUNE_SPARSE if shapes[name]["idx_d"] else A.TUNE, cfg):
                try:
                    row[name] = round(time_attention(c, shapes[name], dev, reps), 2)
                except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                    row[name] = None
                    row.setdefault("errors", {})[name] = repr(e)[:160]
        out.append(row)
    return out


def pick(rows: list[dict], names: list[str]) -> dict | None:
    """The row with the least summed time over `names` (rows missing one are skipped)."""
    ok = [r for r in rows if names and all(isinstance(r.get(n), float) for n in names)]
    return min(ok, key=lambda r: sum(r[n] for n in names)) if ok else None


def scoring_path(shape: dict, dev: torch.device, dtype: torch.dtype, reps: int, gbps: float | None) -> list[dict]:
    """DSA past index_topk at long contexts: prepare with the head weights, the indexer's scores, the top-k, and the
    sparse attention over the selected rows, each timed alone in a graph (T = 1)."""
    from tilepd.engine.dsa_indexer import index_scores
    from tilepd.engine.dsa_topk import topk_select

    rows = []
    a = inputs(shape, 1, 16, dev, dtype)
    cache, icache = a["cache"].clone(), a["icache"].clone()
    for length in SCORING_CONTEXTS:
        g = torch.Generator(device=dev).manual_seed(length)
        keys = torch.randn(length, shape["idx_d"], generator=g, device=dev).to(dtype)
        qi = torch.randn(1, shape["idx_heads"], shape["idx_d"], generator=g, device=dev).to(dtype)
        wts = torch.randn(1, shape["idx_heads"], generator=g, device=dev)
        valid = torch.ones(1, length, dtype=torch.bool, device=dev)
        scores = index_scores(qi, a["cs"], wts, keys, valid, shape["rope"], True)
        c = attention_case(shape, 1, shape["topk"], length, "sparse", dev, dtype)
        rows.append({
            "context": length,
            "prepare_with_head_weights": round(graph_time_us(lambda: run_prepare(a, shape, True, cache, icache), dev, reps), 2),
            "index_scores": round(graph_time_us(lambda: index_scores(qi, a["cs"], wts, keys, valid, shape["rope"], True), dev, reps), 2),
            "topk": round(graph_time_us(lambda: topk_select(scores, valid, shape["topk"]), dev, reps), 2),
            "attention_2048": round(time_attention(c, shape, dev, reps), 2),
            "index_keys_floor_us": round(keys.numel() * keys.element_size() / gbps * 1e-3, 2) if gbps else None,
        })
    return rows


def print_table(report: dict) -> None:
    """Before (the defaults this run started with) and after (the picked tiles), us per call in a graph."""
    rows = [(n, report["attention_before"].get(n), report.get("attention_after", {}).get(n)) for n in report.get("attention_before", {})]
    rows += [(n, report.get("default_us", {}).get(n), report.get("after_us", {}).get(n)) for n in report.get("default_us", {})]
    print(f"{'kernel (us per call)':52s} {'before':>8s} {'after':>8s}")
    for name, before, after in rows:
        print(f"{name:52s} {before if before is not None else '-':>8} {after if after is not None else '-':>8}")
    for row in report.get("scoring_path", []):
        print("scoring", json.dumps(row))
    print("max parity error", max((v for r in report["parity"] for k, v in r.items() if k not in ("T", "shape")), default=None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-rel", type=float, default=2e-2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--best-env", type=Path, help="write the picked tiles here as shell exports")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    shapes = [TINY] if args.tiny else [GLM51, DSV3]
    shape = shapes[0]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report: dict = {"shapes": shapes, "dtype": str(dtype), "tune_default": dict(M.TUNE), "attn_tune_default": dict(A.TUNE),
                    "attn_tune_sparse_default": dict(A.TUNE_SPARSE)}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))

    gbps = None
    if dev.type == "cuda":
        gbps = read_bandwidth(dev, 2.0)["sum_read_GBps"]
        report["gpu"], report["read_GBps"] = torch.cuda.get_device_name(), gbps
    report["parity"] = [row for sh in shapes for row in parity(sh, dev, dtype)]
    print(json.dumps({"parity": report["parity"]}), flush=True)
    ok = all(v < args.max_rel for row in report["parity"] for k, v in row.items() if k not in ("T", "shape"))
    save()
    reps = 20 if dev.type == "cuda" else 1
    env: dict[str, int] = {}

    # the attention at short windows: split kernel + merge_uv, caches rotated past the L2 (as the step's layers read them)
    copies = lambda rows: cache_copies(rows, 1152, dev, 128)  # noqa: E731
    if args.tiny:
        cases = {"tiny 200 dense": attention_case(shape, 1, 200, 200, "dense", dev, dtype),
                 "tiny 48 of 300 sparse": attention_case(shape, 1, 48, 300, "sparse", dev, dtype)}
        case_shape = {n: shape for n in cases}
    else:
        spec = [("glm-5.1 1K sparse-all", GLM51, 1024, 1024, "sparse-all"), ("glm-5.1 1K dense", GLM51, 1024, 1024, "dense"),
                ("glm-5.1 2K dense", GLM51, 2048, 2048, "dense"), ("glm-5.1 2048 of 32K sparse", GLM51, 2048, 32768, "sparse"),
                ("deepseek-v3 1K dense", DSV3, 1024, 1024, "dense"), ("deepseek-v3 4K dense", DSV3, 4096, 4096, "dense"),
                ("glm-5.1 TP8 rank 1K dense", {**GLM51, "heads": GLM51["heads"] // 8}, 1024, 1024, "dense")]  # a TP8 rank's 8 heads
        cases = {n: attention_case(sh, 1, length, rows, mode, dev, dtype, copies(rows)) for n, sh, length, rows, mode in spec}
        case_shape = {n: sh for n, sh, *_ in spec}
    report["attention_before"] = {n: round(time_attention(c, case_shape[n], dev, reps), 2) for n, c in cases.items()}
    print(json.dumps({"attention_before": report["attention_before"]}), flush=True)
    if args.sweep:
        rows = attention_sweep(cases, case_shape, dev, split_tiles(TINY_TILES, TINY_POLICIES) if args.tiny else split_tiles(ATTN_TILES, ATTN_POLICIES),
                               reps)
        report["attention_sweep"] = rows
        dense_names = [n for n in cases if not case_shape[n]["idx_d"]]  # DeepSeek-V3's dense MLA: TUNE
        sparse_names = [n for n in cases if case_shape[n]["idx_d"] and "sparse-all" not in n]  # DSA as the step runs it: TUNE_SPARSE
        best_dense, best_sparse = pick(rows, dense_names), pick(rows, sparse_names)
        report["attention_best"] = {"dense": best_dense, "sparse": best_sparse}
        for prefix, best in (("TILEPD_MLA_", best_dense), ("TILEPD_MLA_SPARSE_", best_sparse)):
            if best:
                env.update({prefix + k.upper(): best[k] for k in TILE_KEYS})
        print(json.dumps({"attention_best": report["attention_best"]}), flush=True)
        for tune, best in ((A.TUNE, best_dense), (A.TUNE_SPARSE, best_sparse)):
            if best:
                tune.update({k: best[k] for k in tune})
        save()

    # prepare and merge_uv alone, GLM-5.1 first (the merge with as many splits as the picked policy gives at 1K)
    first = cases[next(iter(cases))]  # the first shape's shortest window, read as a span (the step at 1K)
    splits = A.split_partials(first["q"], first["caches"][0], shape["rank"], 0.1, first["length"],
                              lo=torch.zeros(1, dtype=torch.long, device=dev), hi=torch.full((1,), first["length"] - 1, device=dev),
                              tune=A.TUNE_SPARSE if shape["idx_d"] else None)[0].shape[2]
    report["merge_splits"] = splits
    a = inputs(shape, 1, splits, dev, dtype)
    cache, icache = a["cache"].clone(), a["icache"].clone()
    base = dict(M.TUNE)
    timers = {
        "prepare (1K: no head weights)": lambda: graph_time_us(lambda: run_prepare(a, shape, False, cache, icache), dev, reps),
        "prepare (past index_topk: with head weights)": lambda: graph_time_us(lambda: run_prepare(a, shape, True, cache, icache), dev, reps),
        f"merge_uv ({splits} splits)": lambda: graph_time_us(lambda: M.merge_uv(a["part"], a["lse"], a["w_uv"], dtype, dtype), dev, reps),
    }
    report["default_us"] = {name: round(fn(), 2) for name, fn in timers.items()}
    report["floor_us"] = {name: round(w.numel() * w.element_size() / gbps * 1e-3, 2) if gbps else None
                          for name, w in (("W_UK", a["w_uk"]), ("W_UV", a["w_uv"]))}
    print(json.dumps({"default_us": report["default_us"], "floor_us": report["floor_us"]}), flush=True)
    if args.sweep:
        report["prepare_sweep"] = sweep(PREPARE_SWEEP if not args.tiny else {"block_c": (64,), "prep_unroll": (0, 1)}, base,
                                        timers["prepare (1K: no head weights)"])
        report["merge_sweep"] = sweep(MERGE_SWEEP if not args.tiny else {"block_v": (16,), "merge_unroll": (0, 1)}, base,
                                      timers[f"merge_uv ({splits} splits)"])
        print(json.dumps({"prepare_best": report["prepare_sweep"][:3], "merge_best": report["merge_sweep"][:3]}), flush=True)
        best = {**report["prepare_sweep"][0], **report["merge_sweep"][0]}
        env.update({f"TILEPD_MLA_FUSED_{k.upper()}": v for k, v in best.items() if k in M.TUNE})
        M.TUNE.update({k: v for k, v in best.items() if k in M.TUNE})
        report["best_env"] = " ".join(f"{k}={v}" for k, v in env.items())
        print("best_env", report["best_env"], flush=True)
        report["after_us"] = {name: round(fn(), 2) for name, fn in timers.items()}
        report["attention_after"] = {n: round(time_attention(c, case_shape[n], dev, reps), 2) for n, c in cases.items()}
        if len(shapes) > 1:  # DeepSeek-V3's prepare and merge with the picked tiles
            b = inputs(DSV3, 1, splits, dev, dtype)
            bc, bi = b["cache"].clone(), b["icache"].clone()
            report["after_us"]["deepseek-v3 prepare"] = round(graph_time_us(lambda: run_prepare(b, DSV3, False, bc, bi), dev, reps), 2)
            report["after_us"]["deepseek-v3 merge_uv"] = round(graph_time_us(lambda: M.merge_uv(b["part"], b["lse"], b["w_uv"], dtype, dtype),
                                                                             dev, reps), 2)
        print(json.dumps({"after_us": report["after_us"], "attention_after": report["attention_after"]}), flush=True)
        save()
    if args.best_env and env:
        args.best_env.write_text("".join(f"export {k}={v}\n" for k, v in env.items()))
    if not args.tiny and shape["idx_d"]:
        report["scoring_path"] = scoring_path(shape, dev, dtype, reps, gbps)
        print(json.dumps({"scoring_path": report["scoring_path"]}), flush=True)
    save()
    print_table(report)
    print("mla fused gpu " + ("ok" if ok else "FAIL: an error above --max-rel"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
