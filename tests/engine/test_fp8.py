"""Block-scaled fp8 weights in the engine: linear / MoE paths against dequantise-then-matmul, the Triton
GEMV under the interpreter, and greedy decodes of fp8-converted tiny models against their dequantised
reference (the same engine on the fp8 values x scales in float32)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tilepd.dev.fp8_checkpoint import write_fp8_checkpoint
from tilepd.engine import KVState, SamplingParams, load_engine
from tilepd.engine.engine import Engine, build_model
from tilepd.model_format.block_fp8 import FP8, BlockFp8, quantize
from tilepd.engine.fp8 import fp8_expert_linear, fp8_linear
from tilepd.engine.layers import linear
from tilepd.engine.moe import moe
from tilepd.weights import convert_weights
from tilepd.engine.weights_loader import load_weights


def ref_dequant(w: BlockFp8) -> torch.Tensor:
    """Independent of tilepd.model_format.block_fp8.dequantize: each element indexes its block's scale."""
    n, k = w.weight.shape[-2:]
    r = torch.arange(n) // w.block[0]
    c = torch.arange(k) // w.block[1]
    return w.weight.float() * w.scale.float()[..., r[:, None], c[None, :]]


def _random_fp8(shape: tuple[int, ...], block: tuple[int, int], seed: int) -> BlockFp8:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g).clamp(-448, 448).to(FP8)
    n, k = shape[-2:]
    scale = torch.rand((*shape[:-2], -(-n // block[0]), -(-k // block[1])), generator=g) * 0.01 + 1e-3
    return BlockFp8(w, scale, block)


@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_fp8_linear_equals_dequantise_then_matmul(block: tuple[int, int]) -> None:
    w = _random_fp8((200, 300), block, 0)  # partial blocks in both dims
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(200, generator=torch.Generator().manual_seed(2))
    want = x @ ref_dequant(w).T + bias
    assert torch.allclose(fp8_linear(x, w, bias), want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(linear(x, w, bias), want, atol=1e-5, rtol=1e-5)  # the decoders' single entry point
    assert fp8_linear(x[None], w).shape == (1, 3, 200)


def test_fp8_experts_and_moe_equal_dense_reference(tiny_deepseek: Path, tmp_path: Path) -> None:
    w = _random_fp8((6, 64, 160), (1, 128), 3)
    ids = torch.tensor([[5, 0], [2, 2]])
    x = torch.randn(2, 160, generator=torch.Generator().manual_seed(4))
    want = torch.einsum("th,tkoh->tko", x, ref_dequant(w)[ids])
    assert torch.allclose(fp8_expert_linear(x, w, ids), want, atol=1e-5)
    x3 = torch.randn(2, 2, 160, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(fp8_expert_linear(x3, w, ids), torch.einsum("tki,tkoi->tko", x3, ref_dequant(w)[ids]), atol=1e-5)
    # A whole MoE layer of a converted tiny model (routed + shared experts): fp8 vs its dequantised weights.
    convert_weights(tiny_deepseek, tmp_path / "fp8", dtype="fp8", progress=False)
    spec, weights = load_weights(tmp_path / "fp8", torch.device("cpu"), torch.float32)
    assert isinstance(weights["layers.1.experts_w13"], BlockFp8) and isinstance(weights["layers.1.shared_w2"], BlockFp8)
    dense = {k: ref_dequant(v) if isinstance(v, BlockFp8) else v for k, v in weights.items()}
    h = torch.randn(3, spec.hidden_size, generator=torch.Generator().manual_seed(6))
    assert torch.allclose(moe(h, weights, "layers.1.", spec), moe(h, dense, "layers.1.", spec), atol=1e-5, rtol=1e-4)


def test_quantize_block_scales_are_amax_over_448() -> None:
    x = torch.randn(130, 260, generator=torch.Generator().manual_seed(7))
    x[:128, 128:256] = 0.0  # an all-zero block: scale 0, values 0
    q = quantize(x)
    assert q.scale.shape == (2, 3) and q.weight.dtype == FP8
    assert torch.equal(q.scale[0, 0], x[:128, :128].abs().amax() / 448) and float(q.scale[0, 1]) == 0.0
    assert torch.equal(q.scale[1, 2], x[128:, 256:].abs().amax() / 448)
    assert float(q.weight.float().abs().max()) == 448.0
    rel = float((ref_dequant(q) - x).norm() / x.norm())
    assert rel < 0.04, rel


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here (the kernel is checked on CUDA by tests/engine/test_fp8_gpu_parity.py, marker gpu)")
def test_triton_gemv_kernel_under_interpreter(repo_root: Path) -> None:
    """The CUDA kernel's code, run by Triton's CPU interpreter on the same cases as the reference."""
    script = textwrap.dedent("""
        import torch
        from tilepd.engine import fp8_triton
        from tilepd.model_format.block_fp8 import BlockFp8, FP8, dequantize
        g = torch.Generator().manual_seed(0)
        def rnd(shape, block):
            n, k = shape[-2:]
            s = torch.rand((*shape[:-2], -(-n // block[0]), -(-k // block[1])), generator=g) * 0.01 + 1e-3
            return BlockFp8(torch.randn(shape, generator=g).to(FP8), s, block)
        w = rnd((200, 300), (128, 128)); x = torch.randn(3, 300, generator=g); b = torch.randn(200, generator=g)
        y = fp8_triton.launch(x, w.weight, w.scale, None, b, 128, 128)
        assert torch.allclose(y, x @ dequantize(w).T + b, atol=1e-4, rtol=1e-5), float((y - x @ dequantize(w).T - b).abs().max())
        e = rnd((5, 96, 256), (1, 128)); ids = torch.tensor([4, 0, 4]); xe = torch.randn(3, 256, generator=g)
        y = fp8_triton.launch(xe, e.weight, e.scale, ids, None, 1, 128)
        ref = ref_e = torch.einsum("ri,roi->ro", xe, dequantize(e[ids]))
        assert torch.allclose(y, ref, atol=1e-4, rtol=1e-5), float((y - ref).abs().max())
        p = rnd((300, 200), (1, 128)); xp = torch.randn(2, 200, generator=g)  # per-row scales: gathered per element
        y = fp8_triton.launch(xp, p.weight, p.scale, None, None, 1, 128)
        assert torch.allclose(y, xp @ dequantize(p).T, atol=1e-4, rtol=1e-5), float((y - xp @ dequantize(p).T).abs().max())
        xb = x.bfloat16(); y = fp8_triton.launch(xb, w.weight, w.scale, None, None, 128, 128)
        ref = xb.float() @ dequantize(w).T
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, rtol=2 ** -7, atol=1e-3), float((y.float() - ref).abs().max())
        # the variants bench/fp8_gemv_sweep.py times: the chunk tile of the earlier default (a full [BLOCK_N,
        # BLOCK_K] accumulator) and the e4m3 -> fp16 bit conversion, on zeros, subnormals and the largest values
        w.weight[0, :8] = torch.tensor([0.0, 2 ** -9, -3 * 2 ** -9, 2 ** -7, 448.0, -448.0, 1.0, -0.0195]).to(FP8)
        want = x @ dequantize(w).T + b
        for tune in ({"block_k": 512, "reduce_each": 0}, {"bits_cvt": 1}, {"bits_cvt": 1, "block_k": 2048}):
            saved = dict(fp8_triton.TUNE); fp8_triton.TUNE.update(tune)
            try:
                y = fp8_triton.launch(x, w.weight, w.scale, None, b, 128, 128)
                ye = fp8_triton.launch(xe, e.weight, e.scale, ids, None, 1, 128)
            finally:
                fp8_triton.TUNE.clear(); fp8_triton.TUNE.update(saved)
            assert torch.allclose(y, want, atol=1e-4, rtol=1e-5), (tune, float((y - want).abs().max()))
            assert torch.allclose(ye, ref_e, atol=1e-4, rtol=1e-5), (tune, float((ye - ref_e).abs().max()))
        # launch_fused with the norm in its prologue: its own chunk (block_k_norm, 2048) and block_k's, K past both
        # with a masked tail, against the unfused ops (the normed row rounded, then times the norm weight, rounded)
        def normed_gemv(x, nw, w):  # the unfused ops' rounding: the normed row, then times the norm weight, in bf16
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
            return ((x.float() * rstd).bfloat16().float() * nw.float()).bfloat16().float() @ dequantize(w).T
        hn = rnd((130, 4100), (128, 128)); xn = torch.randn(2, 4100, generator=g).bfloat16()
        nw = (torch.rand(4100, generator=g) + 0.5).bfloat16()
        want_n = normed_gemv(xn, nw, hn)
        outs = []
        for k_norm in (2048, 0):
            saved = dict(fp8_triton.TUNE); fp8_triton.TUNE["block_k_norm"] = k_norm
            try:
                outs.append(fp8_triton.launch_fused(xn, hn.weight, hn.scale, hn.block, norm_weight=nw, eps=1e-6).float())
            finally:
                fp8_triton.TUNE.clear(); fp8_triton.TUNE.update(saved)
            err = float((outs[-1] - want_n).abs().max() / want_n.abs().max())
            assert outs[-1].shape == (2, 130) and err < 2e-2, (k_norm, err)  # bf16 output: ~1-2 ulps at the largest value
        assert torch.allclose(outs[0], outs[1], rtol=2 ** -7, atol=1e-3), float((outs[0] - outs[1]).abs().max())
        # PRELOAD (pdl.preload_flag: the first chunk and its scales loaded before the wait; PDL is off on CPU, so the
        # flag is forced here): the same sums in the same order, so the same bits, with the norm and the residual over
        # several chunks and a masked tail, one chunk (the loop left empty), per-row scales, and the [N, K] accumulator
        from tilepd.engine import pdl
        real_flag = pdl.preload_flag
        def fused_with(xc, wc, kw, tune, preload):  # launch_fused under TUNE's entries and the forced preload flag
            saved = dict(fp8_triton.TUNE); fp8_triton.TUNE.update(tune); pdl.preload_flag = lambda *a, **k: preload
            try:
                return fp8_triton.launch_fused(xc.contiguous(), wc.weight, wc.scale, wc.block, **kw)
            finally:
                fp8_triton.TUNE.clear(); fp8_triton.TUNE.update(saved); pdl.preload_flag = real_flag
        hr = rnd((130, 300), (1, 128)); xr = torch.randn(2, 300, generator=g).bfloat16()
        res = torch.randn(2, 130, generator=g).bfloat16()
        cases = [(xn, hn, {"norm_weight": nw, "eps": 1e-6, "residual": res}, {}), (xr, hr, {"residual": res}, {}),
                 (xn[:, :1000], rnd((130, 1000), (128, 128)), {}, {}), (xn, hn, {}, {"block_k": 512, "reduce_each": 0})]
        for xc, wc, kw, tune in cases:
            got = [fused_with(xc, wc, kw, tune, forced) for forced in (False, True)]
            assert torch.equal(got[0], got[1]), (tune, list(wc.weight.shape), float((got[0].float() - got[1].float()).abs().max()))
            if tune.get("reduce_each", 1):  # 2 and 4 chunks before the wait: one wider first sum, within float32 rounding
                for cols in (4096, 8192):
                    wide = fused_with(xc, wc, kw, {**tune, "preload_k": cols}, True)
                    assert torch.allclose(wide.float(), got[0].float(), rtol=2 ** -7, atol=1e-3), (cols, float((wide.float() - got[0].float()).abs().max()))
            ref = (xc.float() if "norm_weight" not in kw else None)
            if ref is not None:
                want = ref @ dequantize(wc).T + (res.float() if "residual" in kw else 0)
                assert torch.allclose(got[1].float(), want, rtol=2 ** -6, atol=2e-2), float((got[1].float() - want).abs().max())
        # the short tile (16 rows, 1024-wide chunks: G2's), made to take a 260-row weight over K 1500 (a masked tail)
        # (off by default: TUNE's short_k 0 gives G2 the norm chunk and the picked rows)
        assert fp8_triton.fused_tile(16384, 2048, 1, True)[1] == 2048 and fp8_triton.fused_tile(16384, 2048, 1, True)[0] != 16
        hs = rnd((260, 1500), (128, 128)); xs = torch.randn(1, 1500, generator=g).bfloat16(); ns = (torch.rand(1500, generator=g) + 0.5).bfloat16()
        want_s = normed_gemv(xs, ns, hs)
        saved = dict(fp8_triton.TUNE); fp8_triton.TUNE["short_k"] = 2048
        try:
            assert fp8_triton.fused_tile(16384, 2048, 1, True) == (16, 1024) and fp8_triton.fused_tile(2752, 6144, 1, True)[1] == 2048
            assert fp8_triton.fused_tile(2048, 2048, 1, True) == fp8_triton.fused_tile(2048, 2048, 1, False)[:1] + (2048,)
            assert fp8_triton.fused_tile(16384, 2048, 1, False)[1] == 1024 and fp8_triton.fused_tile(16384, 2048, 1, False)[0] != 16
            fp8_triton.TUNE["short_rows"] = 256
            assert fp8_triton.fused_tile(260, 1500, 1, True) == (16, 1024)
            ys = fp8_triton.launch_fused(xs, hs.weight, hs.scale, hs.block, norm_weight=ns, eps=1e-6).float()
        finally:
            fp8_triton.TUNE.clear(); fp8_triton.TUNE.update(saved)
        err = float((ys - want_s).abs().max() / want_s.abs().max())
        assert ys.shape == (1, 260) and err < 2e-2, err
        print("kernel ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "kernel ok" in r.stdout, r.stderr[-3000:]


def _decode(engine: Engine, n: int) -> tuple[list[int], list[torch.Tensor]]:
    s = engine.config
    g = torch.Generator().manual_seed(0)
    state = KVState(6, [torch.randn(6, s.cache_heads, s.cache_entry_width, generator=g) for _ in range(s.num_layers)])
    if getattr(s, "is_dsa", False):  # sparse models: random indexer keys for every layer with its own indexer
        state.indexer = [None if c is None else torch.randn(6, c.shape[1], generator=g) for c in engine.model.index_cache_list()[: s.num_layers]]
    engine.inject(state)
    engine.eager_step.logits_log = []
    tokens = engine.decode(3, n, SamplingParams(ignore_eos=True), lambda t: None).tokens
    return tokens, engine.eager_step.logits_log


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_deepseek", "tiny_glm5", "tiny_dsv32"])
def test_fp8_model_decodes_like_its_dequantised_reference(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """An fp8 HF checkpoint (block scales, like the real releases) converted with --dtype fp8: the engine on
    fp8 weights gives the greedy tokens of the same engine on the dequantised weights in float32."""
    src = write_fp8_checkpoint(request.getfixturevalue(fixture), tmp_path / "hf-fp8")
    convert_weights(src, tmp_path / "w", dtype="fp8", progress=False)
    fp8_engine = load_engine(tmp_path / "w", device="cpu", max_seq_len=64, dtype="float32", num_speculative_tokens=0)
    fp8_weights = fp8_engine.model.w
    n_fp8 = sum(isinstance(v, BlockFp8) for v in fp8_weights.values())
    assert n_fp8 >= 8, "the GEMV weights should be fp8"
    assert fp8_engine.memory["weights_fp8_gib"] > 0
    spec, weights = load_weights(tmp_path / "w", torch.device("cpu"), torch.float32)
    dense = {k: ref_dequant(v) if isinstance(v, BlockFp8) else v for k, v in weights.items()}
    ref_engine = Engine(build_model(fp8_engine.config, dense, 64, torch.device("cpu"), torch.float32), fp8_engine.config,
                        torch.device("cpu"), 64, use_cuda_graph=False)
    got, got_logits = _decode(fp8_engine, 16)
    want, want_logits = _decode(ref_engine, 16)
    assert got == want
    assert len(set(got)) > 2, f"degenerate decode {got}"
    for a, b in zip(got_logits, want_logits):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
