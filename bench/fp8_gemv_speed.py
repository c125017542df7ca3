"""fp8 vs bf16 GEMV speed and memory on the GPU, with the fp8 kernel's error checked first.

A Llama-3-8B-shaped stack of layer GEMVs (wqkv, wo, w13, w2 per layer; batch 1, bf16 activations), fp8
block-scaled vs bf16, each inside one CUDA graph, with weight bytes, ms per stack, effective GB/s and the
ratio; each Llama GEMV shape under every fp8 tile config (fp8_triton.TUNE); plus DeepSeek-V3-shaped routed
experts (top-8 of 256) through fp8_expert_linear vs the dense gather+einsum. Exits 1 when the kernel's error
against dequantise-then-matmul is beyond tolerance.

    python bench/fp8_gemv_speed.py [--layers 8]
        # was the speed half of `python bench/fp8_gpu_parity.py run`; its parity half is
        # tests/engine/test_fp8_gpu_parity.py (pytest -m gpu)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit import graph_replay_ms
from tilepd.engine.fp8 import fp8_expert_linear, kernel_available
from tilepd.engine.layers import linear
from tilepd.model_format.block_fp8 import BlockFp8, dequantize, quantize


def _nbytes(w) -> int:
    return w.nbytes() if isinstance(w, BlockFp8) else w.numel() * w.element_size()


def speed(layers: int) -> bool:
    dev = torch.device("cuda:0")
    h, inter, qkv = 4096, 14336, (32 + 2 * 8) * 128  # Llama-3-8B
    shapes = [(qkv, h), (h, h), (2 * inter, h), (h, inter)]
    g = torch.Generator(device=dev).manual_seed(0)
    dense = [[(torch.randn(s, device=dev, generator=g) * 0.02).to(torch.bfloat16) for s in shapes] for _ in range(layers)]
    fp8 = [[quantize(w.float()) for w in layer] for layer in dense]
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16)
    xi = torch.randn(1, inter, device=dev, dtype=torch.bfloat16)
    ok = True
    for (n, k), w8 in zip(shapes, fp8[0]):  # kernel vs dequantise-then-matmul at full size
        xin = x if k == h else xi
        y = linear(xin, w8).float()
        ref = xin.float() @ dequantize(w8).T
        err = float((y - ref).abs().max() / ref.abs().max())
        ok &= err < 1e-2
        print(f"kernel check [{n}x{k}]: max err / max |y| = {err:.2e} {'OK' if err < 1e-2 else 'TOO LARGE'}", flush=True)

    _sweep(shapes, fp8, dense, x, xi)

    def stack(ws):
        def run():
            for wqkv, wo, w13, w2 in ws:
                linear(x, wqkv)
                linear(x, wo)
                linear(x, w13)
                linear(xi, w2)
        return run

    res = {}
    for name, ws in (("bf16", dense), ("fp8", fp8)):
        ms = graph_replay_ms(stack(ws))
        nbytes = sum(_nbytes(w) for layer in ws for w in layer)
        res[name] = (ms, nbytes)
        print(f"llama-8B-shaped GEMV stack, {layers} layers, {name:4s}: {nbytes / 2**30:6.3f} GiB  {ms:7.3f} ms  "
              f"{nbytes / ms / 1e6:7.1f} GB/s", flush=True)
    (mb, bb), (mf, bf) = res["bf16"], res["fp8"]
    print(f"llama-8B-shaped GEMV stack: fp8/bf16 bytes {bf / bb:.3f}, time {mf / mb:.3f} (speedup {mb / mf:.2f}x)", flush=True)

    e, top, mi = 64, 8, 2048  # DeepSeek-V3 expert shapes, hidden 7168 (it has 256 experts; a step reads only the top 8)
    hd = 7168
    w13 = (torch.randn(e, 2 * mi, hd, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    w13_8 = BlockFp8(*_quantize_stacked(w13), (128, 128))
    ids = torch.randperm(e, device=dev, generator=g)[:top].view(1, top)
    xd = torch.randn(1, hd, device=dev, dtype=torch.bfloat16)
    ms_d = graph_replay_ms(lambda: torch.einsum("th,tkoh->tko", xd, w13[ids]))
    ms_f = graph_replay_ms(lambda: fp8_expert_linear(xd, w13_8, ids))
    ref = torch.einsum("th,tkoh->tko", xd.float(), dequantize(w13_8[ids]))
    err = float((fp8_expert_linear(xd, w13_8, ids).float() - ref).abs().max() / ref.abs().max())
    ok &= err < 1e-2
    sel = top * 2 * mi * hd  # selected experts' weights; GB/s below = their bytes (bf16: 2 per weight, fp8: 1) / time
    print(f"deepseek-v3-shaped experts w13, top-{top}: bf16 gather+einsum {ms_d:.3f} ms ({2 * sel / ms_d / 1e6:.0f} GB/s), "
          f"fp8 read in place {ms_f:.3f} ms ({sel / ms_f / 1e6:.0f} GB/s); speedup {ms_d / ms_f:.2f}x; err {err:.1e}", flush=True)
    return ok


def _sweep(shapes, fp8, dense, x, xi) -> None:
    """Time each Llama GEMV shape under every kernel tile config (fp8_triton.TUNE) and print bf16, the default
    and the best, so the defaults can be set from the real device. One graph runs the shape's GEMV of every
    layer (distinct weights, more bytes than L2 holds) and the time is divided by the layers."""
    from tilepd.engine import fp8_triton

    saved = dict(fp8_triton.TUNE)

    def per_gemv(ws, xin) -> float:
        def run():
            for w in ws:
                linear(xin, w)
        return graph_replay_ms(run, 20) / len(ws)

    try:
        for i, (n, k) in enumerate(shapes):
            xin = x if k == x.shape[1] else xi
            ws, wd = [layer[i] for layer in fp8], [layer[i] for layer in dense]
            ms_bf16 = per_gemv(wd, xin)
            default = per_gemv(ws, xin)
            best = (default, "default")
            for bn in (8, 16, 32, 64):
                for bk in (128, 256, 512):
                    for warps in (2, 4, 8):
                        fp8_triton.TUNE.update(block_n=bn, block_k=bk, num_warps=warps)
                        try:
                            ms = per_gemv(ws, xin)
                        except Exception as e:  # a config the compiler refuses (registers): skip it
                            print(f"  [{n}x{k}] block_n={bn} block_k={bk} warps={warps}: {type(e).__name__}", flush=True)
                            continue
                        finally:
                            fp8_triton.TUNE.clear()
                            fp8_triton.TUNE.update(saved)
                        if ms < best[0]:
                            best = (ms, f"block_n={bn} block_k={bk} warps={warps}")
            nbytes = ws[0].nbytes()
            print(f"GEMV [{n}x{k}]: bf16 {ms_bf16 * 1e3:7.1f} us ({2 * n * k / ms_bf16 / 1e6:6.0f} GB/s); "
                  f"fp8 default {default * 1e3:7.1f} us ({nbytes / default / 1e6:6.0f} GB/s); "
                  f"best {best[0] * 1e3:7.1f} us ({nbytes / best[0] / 1e6:6.0f} GB/s) with {best[1]}", flush=True)
    finally:
        fp8_triton.TUNE.clear()
        fp8_triton.TUNE.update(saved)


def _quantize_stacked(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qs = [quantize(x.float()) for x in w]
    return torch.stack([q.weight for q in qs]), torch.stack([q.scale for q in qs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="layers in the speed stack (8B has 32; 8 keeps it quick)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, fp8 kernel available: {kernel_available()}", flush=True)
    sys.exit(0 if speed(args.layers) else 1)


if __name__ == "__main__":
    main()
