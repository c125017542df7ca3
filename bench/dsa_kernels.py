"""Microbenchmark: one GLM-5.1 layer's DSA indexer (32 heads x 128 dims, top-2048, bf16 keys) at decode, the torch
reference path (dsa.select_topk: GEMVs, layer_norm, RoPE via cat, index_copy, matmul, relu, head sum, masked_fill,
torch.topk) against the kernel path (the same GEMVs + dsa_indexer.py's two kernels + dsa_topk.py's select), each
captured in a CUDA graph, side by side at L = 1K, 32K, 128K and 200K (GLM-5.1's max_position_embeddings).

Per L: us per layer (graph replay), kernel launches per layer (torch profiler over one eager call), and the select
alone (torch.topk vs topk_select on the same scores). Checks on the GPU, each a pass/fail in the JSON:
  * the select's set equals torch.topk's on the same scores (sorted values equal, no slot twice), and on a
    tie-heavy row;
  * the kernel path's scores against an fp32 evaluation of the reference formula, its key-cache row against
    the reference's, and the overlap of the two paths' selections (bf16 rounding may swap near-ties);
  * the MLA kernel's output does not depend on the order of the selected slots (a shuffled selection);
  * the fused path (index_topk: the scores kernel adds the select's top-byte histogram, then split + refine + finish), on
    outputs allocated over NaN-filled blocks: the histogram equals torch's over the same scores, the scores equal
    the unfused kernel's, the set equals torch.topk's.
Also per L: the scores kernel against its keys-read floor at the measured copy bandwidth, the fused index_topk's us
and launches, the split's candidate count; --sweep adds the scores kernel's and the split's tiles.
CUDA only: `python bench/dsa_kernels.py [--out bench/results/dsa-kernels_h200_DATE.json]`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import GLM5_SMALL, read_bandwidth
from tilepd.engine import dsa_indexer, dsa_topk
from tilepd.engine.dsa import _rope_head, select_topk
from tilepd.engine.layers import length_mask
from tilepd.engine.mla_attention import mla_sparse_attention
from tilepd.engine.rope import apply_rope_interleaved, rope_table
from tilepd.model_format.model_spec import spec_from_hf_config

LENGTHS = (1024, 32768, 131072, 202752)


def _launches(fn) -> int:
    """CUDA kernels one eager call launches (torch profiler); 0 off CUDA (the --device cpu smoke run)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return 0
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 1)) > 0)


def _graph_us(fn) -> float:
    if not torch.cuda.is_available():  # the smoke run: one timed eager call, no graph
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=50, rep=300) * 1e3


def _poison_free_blocks(numel: int, dtype: torch.dtype) -> None:
    """Leave NaN (or all-ones bits) in the allocator's free block of that size, so that an output the kernel under
    test forgets to write shows up as garbage instead of a stale right answer."""
    junk = torch.empty(numel, dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu")
    junk.fill_(float("nan") if dtype.is_floating_point else -1)
    del junk


def _read_bandwidth_gbps() -> float:
    """Read bandwidth as decode_speed.py's floor takes it (kit.read_bandwidth: the better of a read-only sum and a
    copy counting both its reads and writes); 0 off CUDA."""
    if not torch.cuda.is_available():
        return 0.0
    bw = read_bandwidth(torch.device("cuda"), 2.0)
    return max(bw["sum_read_GBps"], bw["copy_rw_GBps"])


def _same_set(scores: torch.Tensor, idx: torch.Tensor, k: int) -> bool:
    ref = scores.topk(k, dim=-1).values
    for r in range(scores.shape[0]):
        if idx[r].unique().numel() != k or not torch.equal(scores[r, idx[r]].sort(descending=True).values, ref[r]):
            return False
    return True


def _sweep(scores_fn, select_fn, key_bytes: int, read_gbps: float) -> list[dict]:
    """us per call of the scores kernel (its histogram epilogue on) over its tiles, and of the select's chunked path over the split's chunk."""
    out = []
    saved_s, saved_t = dict(dsa_indexer.TUNE), dict(dsa_topk.TUNE)
    try:
        for block_l, warps, stages, programs in ((64, 4, 3, 264), (64, 4, 4, 528), (128, 4, 2, 264), (128, 4, 3, 264), (128, 4, 4, 264),
                                                 (128, 8, 3, 264), (128, 4, 3, 528), (128, 8, 3, 528), (256, 8, 3, 264), (256, 8, 2, 132)):
            dsa_indexer.TUNE.update(block_l=block_l, num_warps=warps, num_stages=stages, programs=programs)
            try:
                us = _graph_us(scores_fn)
                out.append({"kernel": "scores", "block_l": block_l, "num_warps": warps, "num_stages": stages, "programs": programs,
                            "us": round(us, 2), "pct_of_read_bw": round(100 * key_bytes / (read_gbps or 4.8e3) / 1e3 / us, 1)})
            except Exception as e:  # a tile that does not compile (shared memory) is a row, not the end of the run
                out.append({"kernel": "scores", "block_l": block_l, "num_warps": warps, "num_stages": stages, "error": str(e)[:200]})
        dsa_indexer.TUNE.update(saved_s)
        dsa_topk.TUNE["one_program_max"] = 0
        for chunk, block, warps in ((2048, 1024, 8), (1024, 1024, 8), (1024, 512, 4), (512, 512, 4)):
            dsa_topk.TUNE.update(chunk=chunk, chunk_block=block, chunk_warps=warps)
            out.append({"kernel": "select (memset, hist0, split, refine, finish)", "chunk": chunk, "chunk_block": block, "chunk_warps": warps,
                        "us": round(_graph_us(select_fn), 2)})
    finally:
        dsa_indexer.TUNE.update(saved_s)
        dsa_topk.TUNE.update(saved_t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--sweep", action="store_true", help="also time the scores kernel's and the split's tiles at L >= 128K")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the checks under TRITON_INTERPRET=1 (timings meaningless)")
    args = ap.parse_args()
    spec = spec_from_hf_config(GLM5_SMALL)
    dev, bf = torch.device(args.device), torch.bfloat16
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("dsa_kernels: needs a CUDA device (or --device cpu under TRITON_INTERPRET=1)")
    h, nh, d, rope, k = spec.hidden_size, spec.index_n_heads, spec.index_head_dim, spec.qk_rope_head_dim, spec.index_topk
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=bf):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    p = "layers.1."
    w = {p + "idx_wk": rnd(d, h, scale=h**-0.5), p + "idx_k_norm": 1 + rnd(d, scale=0.1), p + "idx_k_norm_bias": rnd(d, scale=0.1),
         p + "idx_wq_b": rnd(nh * d, spec.q_lora_rank, scale=spec.q_lora_rank**-0.5),
         p + "idx_weights_proj": rnd(nh, h, scale=h**-0.5, dtype=torch.float32)}
    table = rope_table(rope, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings, max(args.lengths), dev, bf,
                       interleaved=spec.indexer_rope_interleave)
    rows, result = [], {"bench": "dsa_kernels", "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                        "triton": triton.__version__, "shape": {"index_n_heads": nh, "index_head_dim": d, "rope": rope, "index_topk": k,
                                                               "hidden": h, "q_lora_rank": spec.q_lora_rank, "keys": "bf16"},
                        "tune": {"topk": dict(dsa_topk.TUNE), "scores": dict(dsa_indexer.TUNE)}, "date": time.strftime("%Y-%m-%d")}
    ok_all = True
    result["read_GBps"] = round(_read_bandwidth_gbps(), 1)
    for length in args.lengths:
        x, q_resid = rnd(1, h), rnd(1, spec.q_lora_rank)
        positions = torch.tensor([length - 1], device=dev)
        cs = table.index_select(0, positions)
        valid = length_mask(positions, length)
        caches = {name: rnd(length, d) for name in ("reference", "kernels")}
        caches["kernels"].copy_(caches["reference"])
        sel = {}

        def run(name: str) -> None:
            sel[name] = select_topk(w, p, x, q_resid, positions, cs, caches[name], valid, spec, apply_rope_interleaved,
                                    kernels=name == "kernels")

        row = {"L": length, "k": min(k, length)}
        for name in ("reference", "kernels"):
            row[f"{name}_us"] = round(_graph_us(lambda name=name: run(name)), 2)
            row[f"{name}_launches"] = _launches(lambda name=name: run(name))
        run("reference")
        run("kernels")
        kk = min(k, length)
        # the select alone, on one set of scores
        q = torch.nn.functional.linear(q_resid, w[p + "idx_wq_b"]).view(1, nh, d)
        weights = torch.nn.functional.linear(x.float(), w[p + "idx_weights_proj"])
        scores = dsa_indexer.index_scores(q, cs, weights, caches["kernels"], valid, rope, True)
        row["torch_topk_us"] = round(_graph_us(lambda: scores.topk(kk, dim=-1)), 2)
        row["topk_select_us"] = round(_graph_us(lambda: dsa_topk.topk_select(scores, valid, kk)), 2)
        row["topk_path"] = "one-program" if length <= dsa_topk.TUNE["one_program_max"] else "chunked"
        if length <= 32768:  # both select paths side by side where one program per row is still plausible
            saved = dsa_topk.TUNE["one_program_max"]
            for name, limit in (("one_program", 1 << 30), ("chunked", 0)):
                dsa_topk.TUNE["one_program_max"] = limit
                row[f"topk_{name}_us"] = round(_graph_us(lambda: dsa_topk.topk_select(scores, valid, kk)), 2)
                row[f"topk_{name}_same_set"] = _same_set(scores, dsa_topk.topk_select(scores, valid, kk)[0], kk)
            dsa_topk.TUNE["one_program_max"] = saved
        row["scores_kernel_us"] = round(_graph_us(lambda: dsa_indexer.index_scores(q, cs, weights, caches["kernels"], valid, rope, True)), 2)
        key_bytes = length * d * caches["kernels"].element_size()
        row["keys_read_floor_us"] = round(key_bytes / (result["read_GBps"] or 4.8e3) / 1e3, 2)
        row["scores_keys_pct_of_read_bw"] = round(100 * row["keys_read_floor_us"] / row["scores_kernel_us"], 1)
        hist_buf = dsa_topk.new_hist(1, dev)
        row["scores_kernel_with_hist_us"] = round(_graph_us(lambda: dsa_indexer.index_scores(q, cs, weights, caches["kernels"], valid, rope, True,
                                                                                              hist=hist_buf)), 2)
        row["index_topk_us"] = round(_graph_us(lambda: dsa_indexer.index_topk(q, cs, weights, caches["kernels"], valid, rope, True, kk)), 2)
        row["index_topk_launches"] = _launches(lambda: dsa_indexer.index_topk(q, cs, weights, caches["kernels"], valid, rope, True, kk))
        # the fused path on poisoned outputs: its scores' histogram, its set against torch.topk over the same scores
        _poison_free_blocks(length, torch.float32)
        _poison_free_blocks(kk, torch.int64)
        hist = dsa_topk.new_hist(1, dev)
        fused_scores = dsa_indexer.index_scores(q, cs, weights, caches["kernels"], valid, rope, True, hist=hist)
        keys32 = fused_scores.view(torch.int32) ^ ((fused_scores.view(torch.int32) >> 31) & 0x7FFFFFFF)
        row["fused_hist_exact"] = bool(torch.equal(hist[0, :256].long(), torch.bincount(((keys32[0] >> 24) + 128) & 255, minlength=256)))
        row["fused_scores_equal_unfused"] = bool(torch.equal(fused_scores, scores))
        fidx, fok = dsa_topk.topk_select(fused_scores, valid, kk, hist=hist)
        row["fused_select_same_set"] = _same_set(fused_scores, fidx, kk)
        row["fused_ok_matches_valid"] = bool(torch.equal(fok, valid.gather(1, fidx)))
        row["split_candidates"] = int(hist[0, dsa_topk.SPLIT_AT + 1])  # the counters' places in the row's scratch
        row["refined_candidates"] = int(hist[0, dsa_topk.REFINE_AT + 1])
        if args.sweep and length >= 131072:
            row["sweep"] = _sweep(lambda: dsa_indexer.index_scores(q, cs, weights, caches["kernels"], valid, rope, True, hist=hist_buf),
                                  lambda: dsa_topk.topk_select(scores, valid, kk), key_bytes, result["read_GBps"])
        # checks
        idx, _ = dsa_topk.topk_select(scores, valid, kk)
        row["select_same_set"] = _same_set(scores, idx, kk)
        ties = torch.randint(0, 16, (2, length), generator=g, device=dev).float()
        tie_valid = torch.ones_like(ties, dtype=torch.bool)
        row["select_same_set_ties"] = _same_set(ties, dsa_topk.topk_select(ties, tie_valid, kk)[0], kk)
        qr = _rope_head(q, cs, rope, apply_rope_interleaved).float()
        want = torch.relu(torch.matmul(qr, caches["kernels"][:length].float().t()) * d**-0.5)
        want = torch.matmul((weights * nh**-0.5).unsqueeze(1), want).squeeze(1).masked_fill(~valid, float("-inf"))
        row["scores_rel_err"] = float((scores - want).abs().max() / want.abs().max())
        row["key_row_max_err"] = float((caches["kernels"][length - 1].float() - caches["reference"][length - 1].float()).abs().max())
        a, b = set(sel["reference"].idx[0].tolist()), set(sel["kernels"].idx[0].tolist())
        row["paths_overlap"] = round(len(a & b) / kk, 5)
        row["ok_matches_valid"] = bool(torch.equal(sel["kernels"].ok, valid.gather(1, sel["kernels"].idx)))
        lat = rnd(length, 1, spec.kv_lora_rank + rope)
        qm = rnd(1, spec.num_heads, spec.kv_lora_rank + rope)
        i0 = sel["kernels"].idx
        perm = torch.randperm(kk, generator=g, device=dev)
        o1 = mla_sparse_attention(qm, lat, spec.kv_lora_rank, i0, sel["kernels"].ok, 0.07)
        o2 = mla_sparse_attention(qm, lat, spec.kv_lora_rank, i0[:, perm].contiguous(), sel["kernels"].ok[:, perm].contiguous(), 0.07)
        row["mla_order_max_diff"] = float((o1.float() - o2.float()).abs().max())
        passed = (row["fused_hist_exact"] and row["fused_scores_equal_unfused"] and row["fused_select_same_set"] and row["fused_ok_matches_valid"]
                  and row["select_same_set"] and row.get("topk_one_program_same_set", True) and row.get("topk_chunked_same_set", True) and row["select_same_set_ties"] and row["scores_rel_err"] < 2e-2 and row["key_row_max_err"] < 0.1
                  and row["paths_overlap"] > 0.95 and row["ok_matches_valid"] and row["mla_order_max_diff"] < 2e-2)
        row["pass"] = bool(passed)
        ok_all &= passed
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after every row, so a run cut short still leaves its rows
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**result, "rows": rows}, indent=1) + "\n")
        del caches, lat, scores, want
    result["rows"] = rows
    result["all_pass"] = bool(ok_all)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("ALL PASS" if ok_all else "FAIL", flush=True)
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
