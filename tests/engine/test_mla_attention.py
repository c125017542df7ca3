"""The MLA decode kernel (tilepd/engine/mla_attention.py), run by Triton's CPU interpreter, against the
plain PyTorch paths it replaces on CUDA: layers.cached_attention over the latent window (dense) and
dsa.sparse_mla_attention (DSA top-k). Tiny shapes; small tiles so every case spans several chunks,
with lengths that are not multiples of the chunk, masked selection slots and head counts that do not
fill a head group."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")

_CASES = textwrap.dedent("""
    import torch
    from tilepd.engine import mla_attention as M
    from tilepd.engine.dsa import Selection, sparse_mla_attention
    from tilepd.engine.layers import attention_bias, cached_attention, length_mask
    assert M._INTERPRET
    for tune in (M.TUNE, M.TUNE_SPARSE):  # several chunks per case, dense and sparse
        tune.update(block_n=16, block_h=16, min_blocks=1, programs=8)
    M.TUNE_LONG.update({"from": 150, "block_n": 32, "block_h": 16, "min_blocks": 1, "programs": 4})  # windows 150 and 300 take it
    g = torch.Generator().manual_seed(0)
    RANK, ROPE, SLOTS, SCALE = 64, 16, 300, 0.125
    def close(out, ref, dtype, what):
        assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape, out.dtype, ref.dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = float((out.float() - ref.float()).abs().max())
        assert err < tol, (what, err)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(SLOTS, 1, RANK + ROPE, generator=g).to(dtype)
        # dense: (window, heads, positions, lo); lengths off the 16-row tiles, a window past the prefix, MTP's lo > 0
        for window, heads, pos, lo in ((1, 3, [0], 0), (37, 3, [36], 0), (150, 20, [100, 149], 0), (300, 2, [200], 0), (97, 4, [96], 40)):
            t = len(pos)
            q = torch.randn(t, heads, RANK + ROPE, generator=g).to(dtype)
            positions = torch.tensor(pos)
            valid = length_mask(positions, window) & (torch.arange(window) >= lo)[None, :]
            w = cache[:window]
            ref = cached_attention(q, w, w[..., :RANK], attention_bias(valid, heads, dtype), SCALE, impl="bmm")
            lo_t = torch.full((t,), lo, dtype=torch.long)
            out = M.mla_dense_attention(q, cache, RANK, lo_t, positions, window, SCALE)
            close(out, ref, dtype, f"dense {dtype} window={window} heads={heads} pos={pos} lo={lo}")
        # sparse: selections with masked (invalid) slots, repeated indices, one fully valid row
        for t, k, heads in ((1, 48, 3), (2, 70, 20), (3, 16, 2)):
            q = torch.randn(t, heads, RANK + ROPE, generator=g).to(dtype)
            idx = torch.randint(0, SLOTS, (t, k), generator=g)
            ok = torch.rand(t, k, generator=g) > 0.3
            ok[:, 0] = True
            if t > 1:
                ok[1] = True
            ref = sparse_mla_attention(q, cache, RANK, Selection(idx, ok), SCALE)
            out = M.mla_sparse_attention(q, cache, RANK, idx, ok, SCALE)
            close(out, ref, dtype, f"sparse {dtype} t={t} k={k} heads={heads}")
            # masked slots are really ignored: pointing them elsewhere changes nothing
            idx2 = torch.where(ok, idx, torch.randint(0, SLOTS, (t, k), generator=g))
            assert torch.equal(M.mla_sparse_attention(q, cache, RANK, idx2, ok, SCALE), out)
    print("mla kernel ok")
""")


@pytest.mark.slow
def test_mla_kernel_matches_reference_under_interpreter(repo_root: Path) -> None:
    """Dense (length span, MTP's lower bound) and sparse (index list + validity mask), fp32 and bf16."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _CASES], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "mla kernel ok" in r.stdout, r.stderr[-3000:]


def test_mla_kernel_refuses_mismatched_cache() -> None:
    """A cache whose rows are not the query's width is refused by name, not read out of bounds."""
    import torch

    from tilepd.engine import mla_attention as M

    q = torch.zeros(1, 2, 80)
    cache = torch.zeros(10, 1, 96)
    with pytest.raises(ValueError, match="cache rows"):
        M.mla_dense_attention(q, cache, 64, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 10, 1.0)


_ENGINE = textwrap.dedent("""
    import sys
    import torch
    from tilepd.engine import KVState, SamplingParams, layers, load_engine, moe
    from tilepd.engine.mla_fused import DenseSpan
    torch.set_num_threads(1)
    for path in sys.argv[1:]:
        eng = load_engine(path, device="cpu", max_seq_len=128, dtype="float32", use_cuda_graph=True, num_speculative_tokens=0)
        eng.graph_step.buckets = [24, 48, 128]  # static windows past the live prefix, changing mid-run
        s = eng.config
        g = torch.Generator().manual_seed(0)
        state = KVState(20, [torch.randn(20, s.cache_heads, s.cache_entry_width, generator=g) for _ in range(s.num_layers)])
        if s.is_dsa:
            state.indexer = [None if c is None else torch.randn(20, c.shape[1], generator=g) for c in eng.model.index_cache_list()[: s.num_layers]]
        runs = {}
        for impl, experts, router in (("reference", "gather", "torch"), ("triton", "gather", "torch"), ("triton", "triton", "torch"),
                                      ("triton", "triton", "triton")):
            layers.ATTENTION_IMPL["mla"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = impl, experts, router
            eng.inject(state)
            runs[impl, experts, router] = eng.decode(3, 10, SamplingParams(ignore_eos=True), lambda t: None).tokens
        x = torch.zeros(1, 4)
        span = eng.model._dense_mask(x, torch.tensor([5]), torch.ones(1, 24, dtype=torch.bool), eng.model._zero)
        assert isinstance(span, DenseSpan), "the kernel path must be taken under the interpreter"
        assert (runs["triton", "gather", "torch"] == runs["reference", "gather", "torch"] == runs["triton", "triton", "torch"]
                == runs["triton", "triton", "triton"]), (path, runs)
        print(path, "dsa" if s.is_dsa else "dense", runs["triton", "triton", "triton"])
    print("engine ok")
""")


@pytest.mark.slow
def test_engine_decodes_the_same_tokens_through_the_kernel(tiny_deepseek: Path, tiny_glm5: Path, repo_root: Path) -> None:
    """Tiny DeepSeek-V3 (dense MLA) and GLM-5 (DSA, shared layers) on the graph step's static body: the MLA
    kernel, alone, with the expert GEMV (moe_triton.py) and with the fused router (route_triton.py), under the interpreter, gives the reference path's
    greedy tokens, across window changes."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _ENGINE, str(tiny_deepseek), str(tiny_glm5)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "engine ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_accelerate_turns_the_kernels_on_and_undoes_them_first(tiny_deepseek: Path) -> None:
    """compiled.accelerate on a DeepSeek-family model switches MLA attention, the fused attention half-layer and the
    routed experts to the kernels (and concatenates the attention's projections for it); a capture failure undoes the
    fused MoE block, the router, the expert GEMV, the fused attention, then the MLA kernel, before the generic attention."""
    from tilepd.engine import layers, load_engine, mla_fused, moe
    from tilepd.engine.compiled import accelerate

    before = (layers.ATTENTION_IMPL["default"], layers.ATTENTION_IMPL["mla"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"],
              mla_fused.FUSED_IMPL["attention"])
    try:
        eng = load_engine(tiny_deepseek, device="cpu", max_seq_len=64, dtype="float32", num_speculative_tokens=0)
        path = accelerate(eng.model, compile_layers=False)
        assert path.name == "triton-attn+mla-kernel+mla-fused+moe-gemv+moe-route+moe-fused+graph"
        assert (layers.ATTENTION_IMPL["mla"], mla_fused.FUSED_IMPL["attention"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"],
                moe.BLOCK_IMPL["moe"]) == ("triton",) * 5
        assert set(eng.model.fused) == {f"layers.{i}." for i in range(eng.config.num_layers)} | {"mtp.0."}, "every layer's projections joined"
        assert [undo() for undo in path.fallbacks] == ["fused MoE block back to torch", "MoE router back to torch", "routed experts back to gather",
                                                       "fused MLA attention back to torch", "MLA attention back to reference",
                                                       "attention back to sdpa"]
        assert (layers.ATTENTION_IMPL["default"], layers.ATTENTION_IMPL["mla"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"],
                moe.BLOCK_IMPL["moe"], mla_fused.FUSED_IMPL["attention"]) == ("sdpa", "reference", "gather", "torch", "torch", "torch")
        assert accelerate(eng.model, compile_layers=False, mla_attention=False, moe_gemv=False, moe_route=False).name == "triton-attn+graph"
        assert moe.BLOCK_IMPL["moe"] == "torch", "the fused block stands on the expert GEMV and the router kernel"
        assert mla_fused.FUSED_IMPL["attention"] == "torch", "the fused attention stands on the MLA kernel"
        assert accelerate(eng.model, compile_layers=False, moe_fused=False, mla_fused=False).name == \
            "triton-attn+mla-kernel+moe-gemv+moe-route+graph"
    finally:
        (layers.ATTENTION_IMPL["default"], layers.ATTENTION_IMPL["mla"], moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"],
         mla_fused.FUSED_IMPL["attention"]) = before


cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("length,live,t,sparse", [(1, 1, 1, False), (1296, 1100, 1, False), (8464, 8300, 1, False), (520, 300, 3, False),
                                                  (8464, 8300, 1, True), (300, 300, 2, True)])
def test_mla_kernel_on_cuda_matches_fp32_reference(length: int, live: int, t: int, sparse: bool) -> None:
    """DeepSeek-V3 widths (128 heads, latent 512 + rope 64), bf16 cache, against the fp32 reference."""
    import torch

    from tilepd.engine import mla_attention as M
    from tilepd.engine.dsa import Selection, sparse_mla_attention
    from tilepd.engine.layers import attention_bias, cached_attention, length_mask

    g = torch.Generator(device="cuda").manual_seed(0)
    h, r = 128, 512
    cache = torch.randn(length, 1, r + 64, generator=g, device="cuda").bfloat16()
    q = torch.randn(t, h, r + 64, generator=g, device="cuda").bfloat16()
    positions = torch.arange(live - t, live, device="cuda")
    if sparse:
        k = min(2048, live)
        idx = torch.stack([torch.randperm(live, generator=g, device="cuda")[:k] for _ in range(t)])
        ok = idx <= positions[:, None]
        got = M.mla_sparse_attention(q, cache, r, idx, ok, 0.07)
        want = sparse_mla_attention(q.float(), cache.float(), r, Selection(idx, ok), 0.07)
    else:
        got = M.mla_dense_attention(q, cache, r, torch.zeros(t, dtype=torch.long, device="cuda"), positions, length, 0.07)
        bias = attention_bias(length_mask(positions, length), h, torch.float32)
        want = cached_attention(q.float(), cache.float(), cache[..., :r].float(), bias, 0.07, impl="bmm")
    assert got.shape == (t, h, r) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_mla_dense_long_bench_runs_on_tiny_shapes_under_interpreter(repo_root: Path, tmp_path: Path) -> None:
    """bench/mla_dense_long.py's code on a tiny dense shape (CPU, float32), so the GPU bench cannot rot: TUNE's tile and
    each swept tile run through TUNE_LONG and match the float32 reference."""
    import json

    from tests.engine.interpret import interpret

    out = tmp_path / "long.json"
    r = interpret([str(repo_root / "bench" / "mla_dense_long.py"), "--device", "cpu", "--tiny", "--out", str(out)], repo_root, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert len(rows) == 3 and rows[0]["tile"] == report["baseline"]["tile"], rows
    assert all(row["rel_err"] < 1e-5 and row["64"] > 0 and row["256"] > 0 for row in rows), rows
