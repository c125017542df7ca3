"""Microbenchmark: one Llama-3-8B layer's decode attention (32 q heads, 8 KV heads, d=128, bf16) over a
static cache window, split-KV Triton kernel vs torch SDPA vs two batched GEMVs, with the cache bytes
read per call against the measured read bandwidth. CUDA only: `python bench/split_kv_attention.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilepd.engine import layers
from tilepd.engine.attention import split_kv_attention


def main() -> None:
    h, hkv, d = 32, 8, 128
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    bw = x.numel() * 2 / (triton.testing.do_bench(lambda: x.sum(dtype=torch.float32)) * 1e-3)
    del x
    print(f"read bandwidth {bw / 1e9:.0f} GB/s")
    for length in (1296, 8464):
        cache = torch.randn(length, hkv, 2 * d, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, h, d, device="cuda", dtype=torch.bfloat16)
        bias = layers.attention_bias(layers.length_mask(torch.tensor([length - 200], device="cuda"), length), h // hkv, torch.bfloat16)
        k, v = cache[..., :d], cache[..., d:]
        floor_us = cache.numel() * 2 / bw * 1e6
        for name, fn in (("triton", lambda: split_kv_attention(q, k, v, bias, d**-0.5)),
                         ("sdpa", lambda: layers.cached_attention(q, k, v, bias, d**-0.5, impl="sdpa")),
                         ("bmm", lambda: layers.cached_attention(q, k, v, bias, d**-0.5, impl="bmm"))):
            g = torch.cuda.CUDAGraph()
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fn()
            us = triton.testing.do_bench(g.replay) * 1e3
            print(f"window {length}: {name:6s} {us:7.1f} us  (whole-window read floor {floor_us:.1f} us)")


if __name__ == "__main__":
    main()
