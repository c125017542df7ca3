"""DeepGEMM's fp8 MQA logits (the indexer's scores in vLLM/SGLang) beside dsa_indexer.index_scores, one decode row.

Issue 24 names it as the library candidate for DSA's scores. It reads fp8 keys with one fp32 scale a row (132 B a key,
vLLM's indexer cache) where the engine's cache holds bf16 (256 B), so the two are compared each against its own
keys-read floor. Only if `import deep_gemm` works (the sgl-deep-gemm wheel, CUDA 13, carried to the device and put
on sys.path with --wheel-dir): the JSON says why not otherwise. Checks its logits against an fp32 evaluation of
sum_h w_h * relu(q_h . k_l * scale_l) over the dequantised keys.

    python bench/dsa_deepgemm_logits.py --wheel-dir /tmp/dg --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel-dir", type=Path, default=None, help="a folder the sgl-deep-gemm wheel was unpacked into")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 202752])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.wheel_dir:
        sys.path.insert(0, str(args.wheel_dir))
    result: dict = {"bench": "dsa_deepgemm_logits", "rows": []}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    try:
        import deep_gemm
        result["deep_gemm"] = getattr(deep_gemm, "__version__", "?")
    except Exception as e:
        result["import_error"] = f"{type(e).__name__}: {e}"[:2000]
        write()
        print(json.dumps(result))
        return
    import triton.testing

    from tilepd.engine import dsa_indexer

    heads, d = 32, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    for length in args.lengths:
        row: dict = {"L": length}
        q = torch.randn(1, heads, d, generator=g, device="cuda")
        keys = torch.randn(length, d, generator=g, device="cuda")
        weights = torch.randn(1, heads, generator=g, device="cuda")
        amax = keys.abs().amax(dim=1).clamp_min(1e-4)
        sf = (amax / 448.0).float()
        kv_fp8 = (keys / sf[:, None]).to(torch.float8_e4m3fn)
        q_fp8 = q.to(torch.float8_e4m3fn)
        ks = torch.zeros(1, dtype=torch.int32, device="cuda")
        ke = torch.full((1,), length, dtype=torch.int32, device="cuda")
        want = ((q_fp8.float()[0] @ (kv_fp8.float() * sf[:, None]).t()).relu() * weights[0][:, None]).sum(0)
        try:
            if hasattr(deep_gemm, "fp8_fp4_mqa_logits"):
                fn = lambda: deep_gemm.fp8_fp4_mqa_logits(q_fp8, (kv_fp8, sf), weights, ks, ke, length)  # noqa: E731
            else:
                fn = lambda: deep_gemm.fp8_mqa_logits(q_fp8, (kv_fp8, sf), weights, ks, ke)  # noqa: E731
            got = fn()
            torch.cuda.synchronize()
            got = got.reshape(-1)[:length].float()
            row["rel_err"] = float((got - want).abs().max() / want.abs().max())
            row["deepgemm_us"] = round(triton.testing.do_bench(fn, warmup=20, rep=200) * 1e3, 2)
            row["deepgemm_key_bytes"] = length * (d + 4)
        except Exception:
            row["deepgemm_error"] = traceback.format_exc()[-1500:]
        # ours on bf16 keys (the engine's cache), same q / weights, no RoPE (rope 0)
        kb = keys.bfloat16()
        cs = torch.zeros(1, 2, d, device="cuda", dtype=torch.bfloat16)
        valid = torch.ones(1, length, dtype=torch.bool, device="cuda")
        ours = lambda: dsa_indexer.index_scores(q.bfloat16(), cs, weights * heads**0.5 * d**0.5, kb, valid, 0, True)  # noqa: E731
        row["ours_us"] = round(triton.testing.do_bench(ours, warmup=20, rep=200) * 1e3, 2)
        row["ours_key_bytes"] = length * d * 2
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        write()
    write()


if __name__ == "__main__":
    main()
