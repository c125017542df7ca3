"""The fused MLA attention half-layer (mla_fused.py, mla_fused_triton.py) under Triton's CPU interpreter.

Kernels: `prepare` (W_UK absorb + q RoPE, the latent's norm + RoPE into the cache, the indexer key into its cache)
with the indexer's head weights, and `merge_uv` (split-KV merge + W_UV) against the model's own ops (their references), fp32 and bf16, both RoPE
layouts, T > 1, a strided kv view (the GEMV output's column slice), heads whose splits saw nothing.
Engine: an fp8 checkpoint (block scales off the rows' block grid) decodes the same tokens through the fused path as
through the model's reference ops on the same weights, and the joined projections keep their values on and off the
grid. HF's greedy tokens through the whole speed path (this half-layer included) are test_dsa_kernels.py's engine test."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")

_KERNELS = textwrap.dedent("""
    import torch
    from tilepd.engine import mla_fused_triton as M
    from tilepd.engine.rope import rope_table
    g = torch.Generator().manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        tol = 2e-5 if dtype == torch.float32 else 4e-2
        for interleaved in (True, False):
            for t, h, nope, rank, rope, with_index in ((1, 2, 32, 128, 64, True), (3, 3, 48, 256, 32, False), (2, 2, 40, 128, 64, True),
                                                       (2, 2, 16, 64, 16, True)):
                slots = 40
                table = rope_table(rope, 10000.0, None, 4096, slots, torch.device("cpu"), dtype, interleaved=interleaved)
                positions = torch.arange(slots - t - 3, slots - 3)
                cs = table.index_select(0, positions)
                q = torch.randn(t, h * (nope + rope), generator=g).to(dtype)
                kv = torch.randn(t, rank + rope + 8, generator=g).to(dtype)[:, 4:4 + rank + rope]  # strided, as a GEMV output slice
                w_uk = (torch.randn(h, nope, rank, generator=g) * 0.1).to(dtype)
                kvn = (1 + 0.1 * torch.randn(rank, generator=g)).to(dtype)
                cache = torch.randn(slots, 1, rank + rope, generator=g).to(dtype)
                ref_cache = cache.clone()
                index = ref_index = head_weights = None
                if with_index:
                    x = torch.randn(t, 1100, generator=g).to(dtype)  # past one 1024-wide chunk, off the chunk
                    xn = (1 + 0.1 * torch.randn(1100, generator=g)).to(dtype)
                    head_weights = (x, xn, 1e-5, torch.randn(5, 1100, generator=g))  # fp32, as HF keeps weights_proj
                    d = 128
                    kx = torch.randn(t, d, generator=g).to(dtype)
                    kn, kb = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype), (0.1 * torch.randn(d, generator=g)).to(dtype)
                    ic = torch.randn(slots, d, generator=g).to(dtype)
                    ric = ic.clone()
                    index, ref_index = (kx, kn, kb, cs, ic, interleaved), (kx, kn, kb, cs, ric, interleaved)
                got, got_w = M.prepare(q, kv, w_uk, kvn, 1e-6, cs, positions, cache, rank, rope, interleaved, index, head_weights)
                want, want_w = M.prepare_reference(q, kv, w_uk, kvn, 1e-6, cs, positions, ref_cache, rank, rope, interleaved, ref_index,
                                                   head_weights)
                pairs = [("q", got, want), ("cache", cache, ref_cache)]
                if with_index:
                    assert got_w.dtype == torch.float32 and got_w.shape == (t, 5)
                    pairs += [("index cache", ic, ric), ("head weights", got_w, want_w)]
                else:
                    assert got_w is None and want_w is None
                for name, a, b in pairs:
                    err = float((a.float() - b.float()).abs().max() / b.float().abs().max())
                    assert err < tol, (name, dtype, interleaved, t, h, err)
                s, v = 5, 48
                part = torch.randn(t, h, s, rank, generator=g)
                lse = torch.randn(t, h, s, generator=g) * 3
                lse[0, 0, 1] = float("-inf")
                if h > 1:
                    lse[0, 1, :] = float("-inf")  # a head whose every split saw nothing: zeros, as the merge gives
                w_uv = (torch.randn(h, v, rank, generator=g) * 0.1).to(dtype)
                got = M.merge_uv(part, lse, w_uv, dtype, dtype)
                want = M.merge_uv_reference(part, lse, w_uv, dtype, dtype)
                err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                assert got.shape == (t, h * v) and got.dtype == dtype and err < tol, ("merge_uv", dtype, t, h, err)
                n += 1
    print("kernels ok", n)
""")

# Few programs per launch: the interpreter pays per program, not per element.
_FAST_TILES = "from tilepd.engine import fp8_triton, gemv_triton\ngemv_triton.TUNE['block_n'] = 256\nfp8_triton.TUNE['block_n'] = 128\n"

_FP8 = _FAST_TILES + textwrap.dedent("""
    import sys
    import torch
    from tilepd.engine import KVState, SamplingParams, layers, load_engine, mla_fused
    from tilepd.model_format.block_fp8 import BlockFp8
    torch.set_num_threads(1)
    eng = load_engine(sys.argv[1], device="cpu", max_seq_len=64, dtype="float32", num_speculative_tokens=0)
    s = eng.config
    g = torch.Generator().manual_seed(0)
    for seq in (6, 40):  # below and above index_topk (16)
        state = KVState(seq, [torch.randn(seq, s.cache_heads, s.cache_entry_width, generator=g) for _ in range(s.num_layers)])
        state.indexer = [None if c is None else torch.randn(seq, c.shape[1], generator=g) for c in eng.model.index_cache_list()[: s.num_layers]]
        runs = {}
        for impl in ("reference", "fused"):
            layers.ATTENTION_IMPL["mla"] = "triton" if impl == "fused" else "reference"
            mla_fused.FUSED_IMPL["attention"] = "triton" if impl == "fused" else "torch"
            if impl == "fused":
                mla_fused.prepare_model(eng.model)
                blocks = {g_.weight.block for f in eng.model.fused.values() for g_ in f.a_groups if isinstance(g_.weight, BlockFp8)}
                print("G1 blocks", sorted(blocks), flush=True)
            eng.inject(state)
            runs[impl] = eng.decode(3, 8, SamplingParams(ignore_eos=True), lambda t: None).tokens
        assert runs["fused"] == runs["reference"] and len(set(runs["fused"])) > 2, (seq, runs)
        print("fp8", seq, "ok", flush=True)
    print("fp8 ok")
""")


def _interpret(code: str, repo_root: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_kernels_match_the_model_ops_under_interpreter(repo_root: Path) -> None:
    r = _interpret(_KERNELS, repo_root)
    assert r.returncode == 0 and "kernels ok 16" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.slow
def test_fp8_glm5_decodes_the_same_through_the_fused_attention(tiny_glm5: Path, repo_root: Path, tmp_path: Path) -> None:
    """The tiny model's G1 parts (q_a 64 rows, the indexer key 128, kv_a 576) are off the 128-row block grid, so their
    concatenation keeps one scale per row; the fused path decodes the tokens the reference ops decode on the same weights."""
    from tilepd.dev.fp8_checkpoint import write_fp8_checkpoint
    from tilepd.weights.convert import convert_weights

    src = write_fp8_checkpoint(tiny_glm5, tmp_path / "hf-fp8")
    convert_weights(src, tmp_path / "w", dtype="fp8", progress=False)
    r = _interpret(_FP8, repo_root, str(tmp_path / "w"))
    assert r.returncode == 0 and "fp8 ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "G1 blocks [(1, 128)]" in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("rows", [(256, 128, 384), (64, 128, 576)], ids=["on-the-block-grid", "off-the-block-grid"])
def test_concatenated_fp8_parts_keep_their_values_and_the_entries_become_views(rows: tuple[int, ...]) -> None:
    """_concat on block-scaled parts: the joined weight dequantises to the parts stacked; on the 128-row grid the block
    scales are joined as they are, off it each row keeps its own scale (block_n 1); each part's new entry is a view."""
    from tilepd.engine import mla_fused
    from tilepd.model_format.block_fp8 import BlockFp8, dequantize, quantize

    g = torch.Generator().manual_seed(0)
    parts = [(f"p{i}", quantize(torch.randn(n, 256, generator=g))) for i, n in enumerate(rows)]
    group, views = mla_fused._concat(parts)
    assert isinstance(group.weight, BlockFp8)
    assert group.weight.block == ((128, 128) if rows[0] % 128 == 0 else (1, 128))
    assert torch.equal(dequantize(group.weight), torch.cat([dequantize(w) for _, w in parts]))
    for name, w in parts:
        a, b = group.parts[name]
        assert b - a == w.shape[0] and torch.equal(dequantize(views[name]), dequantize(w))
        assert views[name].weight.untyped_storage().data_ptr() == group.weight.weight.untyped_storage().data_ptr()
    assert group.rows_for({"p0"}) == rows[0] and group.rows_for({"p0", "p2"}) == sum(rows)
