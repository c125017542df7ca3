"""The persistent MLA attention core (mla_core_triton) against the three kernels it replaces, and its sm_90 build.

Under Triton's CPU interpreter the core runs each phase as a launch of its own (its programs run one after another, so
a grid barrier would wait forever: grid_sync's docstring); the phases are the core kernel's own code, so this checks
its item loops, the argument plumbing and the preloaded merge against prepare -> split_partials -> merge_uv (each of
which test_mla_fused.py / test_mla_attention.py check against the model's ops). The one-launch form with its barrier
is checked here only as an sm_90 build (it compiles, the barrier is one gpu-scope acq_rel add and acquire loads, no
spills at GLM-5.1's shapes); it runs on a GPU in test_mla_gpu_parity.py and under bench/depth_step.sh's parity step."""

from __future__ import annotations

import importlib.util
import os
import re
import textwrap
from pathlib import Path

import pytest
import torch

from tests.engine.interpret import interpret

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")

_CORE = textwrap.dedent("""
    import torch
    from tilepd.engine import mla_attention as A, mla_core_triton as K, mla_fused_triton as M
    from tilepd.engine.rope import rope_table
    g = torch.Generator().manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        # (tokens, heads, nope, rank, rope, v, span, prepare in the core, W_UV preloaded)
        for t, h, nope, rank, rope, v, span, with_prep, preload in ((1, 3, 48, 128, 32, 40, "dense", True, 1),
                                                                    (2, 2, 32, 64, 16, 48, "sparse", True, 0),
                                                                    (1, 2, 32, 64, 16, 48, "sparse", False, 1),
                                                                    (2, 3, 40, 128, 32, 24, "dense", False, 0)):
            K.TUNE["preload"] = preload
            slots = 70
            table = rope_table(rope, 10000.0, None, 4096, slots, torch.device("cpu"), dtype, interleaved=True)
            positions = torch.arange(slots - t - 3, slots - 3)
            cs = table.index_select(0, positions)
            cache = torch.randn(slots, 1, rank + rope, generator=g).to(dtype)
            w_uv = (torch.randn(h, v, rank, generator=g) * 0.1).to(dtype)
            if span == "dense":  # token i sees slots lo..hi (the last token one fewer: an MTP-like span)
                kw = {"length": slots, "lo": torch.zeros(t, dtype=torch.int64), "hi": positions - torch.arange(t - 1, -1, -1)}
            else:  # 40 selected slots, some not ok
                idx = torch.stack([torch.randperm(slots, generator=g)[:40] for _ in range(t)])
                ok = torch.rand(t, 40, generator=g) > 0.2
                kw = {"length": 40, "idx": idx, "ok": ok}
            ref_cache = cache.clone()
            if with_prep:
                q = torch.randn(t, h * (nope + rope), generator=g).to(dtype)
                kv = torch.randn(t, rank + rope + 8, generator=g).to(dtype)[:, 4:4 + rank + rope]
                w_uk = (torch.randn(h, nope, rank, generator=g) * 0.1).to(dtype)
                kvn = (1 + 0.1 * torch.randn(rank, generator=g)).to(dtype)
                args = (q, kv, w_uk, kvn, 1e-6, cs, positions)
                prep = M.prepare_plan(*args, cache, rank, rope, True, block_c=K.TUNE["block_c"], unroll=True)
                q_cat = prep.outputs[0]
                want_q, _ = M.prepare(*args, ref_cache, rank, rope, True)
            else:
                prep = None
                q_cat = want_q = torch.randn(t, h, rank + rope, generator=g).to(dtype)
            got = K.attention_core(prep, A.split_plan(q_cat, cache, rank, 0.125, **kw), w_uv, dtype, dtype)
            part, lse = A.split_partials(want_q, ref_cache, rank, 0.125, **kw)
            want = M.merge_uv(part, lse, w_uv, dtype, dtype)
            assert torch.equal(cache, ref_cache), (dtype, t, h, span, "the cache rows prepare writes")
            assert torch.equal(q_cat, want_q), (dtype, t, h, span, "the query rows")
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            assert got.shape == (t, h * v) and got.dtype == dtype and err < tol, (dtype, t, h, span, with_prep, preload, err)
            n += 1
    print("core ok", n)
""")


@pytest.mark.slow
def test_core_matches_the_three_kernels_under_interpreter(repo_root: Path) -> None:
    r = interpret(["-c", _CORE], repo_root, timeout=900)
    assert r.returncode == 0 and "core ok 8" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.skipif(os.environ.get("TILEPD_SKIP_SM90_COMPILE") == "1", reason="TILEPD_SKIP_SM90_COMPILE=1")
@pytest.mark.parametrize("form", ["1K-dense-span", "past-index_topk"])
def test_core_builds_for_sm90_with_its_barrier_and_no_spills(monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """GLM-5.1's shapes: at 1K the core runs prepare, the split over the window's span and the merge (two barriers); past
    index_topk prepare is a launch of its own and the core runs the split over the selection and the merge (one)."""
    from tests.engine.sm90_compile import compiling, ptxas_info
    from tilepd.engine import grid_sync, mla_attention as A, mla_core_triton as K, mla_fused_triton as M, pdl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "enabled", lambda t, kind="gemv": True)
    bf = torch.bfloat16
    t, heads, nope, rank, rope, v = 1, 64, 192, 512, 64, 256
    cs = torch.randn(t, 2, rope).to(bf)
    cache = torch.zeros(1400, 1, rank + rope, dtype=bf)
    w_uv = torch.randn(heads, v, rank).to(bf)
    with compiling() as done:
        if form == "1K-dense-span":
            index = (torch.randn(t, 128).to(bf), torch.ones(128, dtype=bf), torch.zeros(128, dtype=bf), cs, torch.zeros(1400, 128, dtype=bf), True)
            prep = M.prepare_plan(torch.randn(t, heads * (nope + rope)).to(bf), torch.randn(t, rank + rope).to(bf),
                                  torch.randn(heads, nope, rank).to(bf), torch.ones(rank, dtype=bf), 1e-6, cs, torch.zeros(t, dtype=torch.int64),
                                  cache, rank, rope, True, index, block_c=K.TUNE["block_c"], unroll=bool(K.TUNE["prep_unroll"]))
            split = A.split_plan(prep.outputs[0], cache, rank, 0.1, 1296, lo=torch.zeros(t, dtype=torch.int64),
                                 hi=torch.full((t,), 1023, dtype=torch.int64), tune=A.TUNE_SPARSE)
        else:
            prep = None
            split = A.split_plan(torch.randn(t, heads, rank + rope).to(bf), cache, rank, 0.1, 2048, idx=torch.zeros(t, 2048, dtype=torch.int64),
                                 ok=torch.ones(t, 2048, dtype=torch.bool))
        K.attention_core(prep, split, w_uv, bf, bf, one_launch=True, programs=132)
    (core,) = done
    assert core["name"] == "_core_kernel" and core["constexprs"]["SYNC"] and core["constexprs"]["PRELOAD"], core["constexprs"]
    # the grid: the most items of a phase (prepare's 130 at 1K: 64 heads x 2 absorb tiles + the latent + the index key;
    # 128 merge items past index_topk), and the barrier's counter is that grid size's own
    grid = 130 if prep is not None else 128
    assert (torch.device("cpu"), f"MLA core barrier/{grid}") in grid_sync._COUNTERS
    assert core["constexprs"]["PHASES"] == (7 if prep is not None else 6)
    ptx = core["ptx"]
    arrivals = re.findall(r"atom\.global\.gpu\.acq_rel\.add\.u64", ptx)
    assert len(arrivals) == (2 if prep is not None else 1), arrivals
    assert "ld.global.gpu.acquire.b64" in ptx  # the poll
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    info = ptxas_info(ptx)
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


def test_the_placeholders_without_prepare_line_up_with_prepares_arguments() -> None:
    """Past index_topk the core passes `_no_prepare`'s placeholders in prepare's argument slots (compiled out, never
    read): as many as a real prepare plan has, each of its kind (a tensor, a float, an int), and every constexpr of
    prepare's that the split or the merge does not bring. A new argument of _prepare_kernel fails here, not on a GPU."""
    from tilepd.engine import mla_attention as A, mla_core_triton as K, mla_fused_triton as M

    t, heads, nope, rank, rope = 1, 2, 32, 64, 16
    cs = torch.randn(t, 2, rope)
    cache = torch.zeros(40, 1, rank + rope)
    index = (torch.randn(t, 32), torch.ones(32), torch.zeros(32), cs, torch.zeros(40, 32), True)
    prep = M.prepare_plan(torch.randn(t, heads * (nope + rope)), torch.randn(t, rank + rope), torch.randn(heads, nope, rank),
                          torch.ones(rank), 1e-6, cs, torch.zeros(t, dtype=torch.int64), cache, rank, rope, True, index,
                          (torch.randn(t, 48), torch.ones(48), 1e-6, torch.randn(4, 48)))
    split = A.split_plan(prep.outputs[0], cache, rank, 0.1, 8, idx=torch.zeros(t, 8, dtype=torch.int64), ok=torch.ones(t, 8, dtype=torch.bool))
    args, constexprs = K._no_prepare(split)

    def kind(a: object) -> str:
        return "tensor" if isinstance(a, torch.Tensor) else type(a).__name__

    assert [kind(a) for a in args] == [kind(a) for a in prep.args]
    assert set(prep.constexprs) - set(constexprs) - set(split.constexprs) == {"ACT"}  # the merge plan's, which the core always has
