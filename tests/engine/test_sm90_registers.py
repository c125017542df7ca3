"""The fused decode step's kernels at GLM-5.1's served shapes, built for sm_90 as a device launch builds them
(tests/engine/sm90_compile.py: the launcher's own specialization, Triton's ptxas, no GPU): none spills registers to local
memory, with the switch that is off by default (PDL's widest form) on as well. A spill in a bandwidth- or latency-bound
kernel of the step costs more than the tile it bought; the interpreter never builds these forms, so this is the CPU's
one look at them. It is the look of the Triton the project installs (3.9 here); the device's own (3.6 on the H200/H100
images, 2026-12) may allocate otherwise, so a kernel near the limit is the device's to confirm."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here"),
              pytest.mark.skipif(os.environ.get("TILEPD_SKIP_SM90_COMPILE") == "1", reason="TILEPD_SKIP_SM90_COMPILE=1")]


def _fp8(g: torch.Generator, n: int, k: int) -> object:
    """A random [n, k] weight quantised to 128x128-block fp8 (BlockFp8)."""
    from tilepd.model_format.block_fp8 import quantize

    return quantize(torch.randn(n, k, generator=g), (128, 128))


def _stacked(g: torch.Generator, n: int, k: int, experts: int) -> object:
    """`experts` random [n, k] fp8 weights stacked as the MoE kernels take them (BlockFp8 of [E, n, k])."""
    from tilepd.model_format.block_fp8 import BlockFp8

    parts = [_fp8(g, n, k) for _ in range(experts)]
    return BlockFp8(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), (128, 128))


def _step_kernels() -> list[dict]:
    from tests.engine.sm90_compile import compiling
    from tilepd.engine import fp8_triton, mla_attention, mla_fused_triton, moe_fused_triton

    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    t, hid, heads, nope, rank, rope, v, inter, experts = 1, 6144, 64, 192, 512, 64, 256, 2048, 8  # GLM-5.1 (8 of 256 experts built)

    def fp8(n: int, k: int) -> object:
        return _fp8(g, n, k)

    def stacked(n: int, k: int) -> object:
        return _stacked(g, n, k, experts)

    x = torch.randn(t, hid).to(bf)
    cs = torch.randn(t, 2, rope).to(bf)
    cache = torch.zeros(1100, 1, rank + rope, dtype=bf)
    index = (torch.randn(t, 128).to(bf), torch.ones(128, dtype=bf), torch.zeros(128, dtype=bf), cs, torch.zeros(1100, 128, dtype=bf), True)
    w_uv, wo = torch.randn(heads, v, rank).to(bf), fp8(hid, heads * v)
    with compiling() as done:
        w_uk = torch.randn(heads, nope, rank).to(bf)
        g2 = fp8(16384, 2048)
        for norm, weight in ((6144, fp8(2752, 6144)), (2048, g2)):
            fp8_triton.launch_fused(torch.randn(t, norm).to(bf), weight.weight, weight.scale, weight.block, norm_weight=torch.ones(norm, dtype=bf),
                                    eps=1e-6)
        mla_fused_triton.prepare(torch.randn(t, heads * (nope + rope)).to(bf), torch.randn(t, rank + rope).to(bf), w_uk,
                                 torch.ones(rank, dtype=bf), 1e-6, cs, torch.zeros(t, dtype=torch.int64), cache, rank, rope, True, index)
        part, lse = mla_attention.split_partials(torch.randn(t, heads, rank + rope).to(bf), cache, rank, 0.1, 1024,
                                                 lo=torch.zeros(t, dtype=torch.int64), hi=torch.full((t,), 1023, dtype=torch.int64),
                                                 tune=mla_attention.TUNE_SPARSE)
        mla_fused_triton.merge_uv(part, lse, w_uv, bf, bf)
        fp8_triton.launch_fused(torch.randn(t, heads * v).to(bf), wo.weight, wo.scale, wo.block, residual=x)
        shared13 = fp8(2 * inter, hid)
        moe_fused_triton.gate_route(x, torch.ones(hid, dtype=bf), 1e-6, torch.randn(256, hid), torch.zeros(256), 1, 1, 8, True, 2.5)
        ids = torch.tensor([[3, 1, 2, 4, 5, 6, 7, 0, -1]])
        moe_fused_triton.gate_up_act(x, stacked(2 * inter, hid), shared13, ids, shared_last=True)
        moe_fused_triton.down_combine(torch.randn(9, inter).to(bf), stacked(hid, inter), fp8(hid, inter), ids, torch.ones(1, 9, dtype=bf), x,
                                      shared_last=True)
    return done


@pytest.mark.parametrize("switches", ["defaults", "all-on"])
def test_the_step_kernels_do_not_spill_at_glm51_shapes(monkeypatch: pytest.MonkeyPatch, switches: str) -> None:
    from tests.engine.sm90_compile import ptxas_info
    from tilepd.engine import fp8_triton, pdl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if switches == "all-on":
        monkeypatch.setattr(pdl, "enabled", lambda t, kind="gemv": True)
        monkeypatch.setitem(pdl.SWITCH, "trigger", 1)
        monkeypatch.setitem(pdl.SWITCH, "prefetch", 1)
        monkeypatch.setitem(pdl.SWITCH, "preload_at", frozenset(pdl.SITES))  # the fp8 GEMVs' weights into registers before the wait
        monkeypatch.setitem(fp8_triton.TUNE, "preload_k", 4096)  # G1 two chunks, wo four
    done = _step_kernels()
    if switches == "all-on":
        assert [d["constexprs"]["PRELOAD_K"] for d in done if d["name"] == "_fp8_gemv_kernel"] == [4096, 2048, 4096]
    names = [d["name"] for d in done]
    assert names == ["_fp8_gemv_kernel", "_fp8_gemv_kernel", "_prepare_kernel", "_mla_split_kernel", "_merge_uv_kernel", "_fp8_gemv_kernel",
                     "_gate_kernel", "_route_kernel", "_gate_up_kernel", "_down_kernel"], names
    report = {f"{i}:{d['name']}": ptxas_info(d["ptx"]) for i, d in enumerate(done)}
    spilled = {k: r for k, r in report.items() if r["spill_stores"] or r["spill_loads"]}
    assert not spilled, spilled
    assert all(0 < r["registers"] <= 255 for r in report.values()), report


def test_a_tp8_shards_gate_up_takes_the_narrow_tile_without_spills(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5.1's experts at TP8 (256 rows a shard: 288 programs at the wide tile) take moe_fused_triton's few-programs
    tile (4 rows, 1024-wide chunks), and its sm_90 build spills nothing."""
    from tests.engine.sm90_compile import compiling, ptxas_info
    from tilepd.engine import moe_fused_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    hid, inter, experts = 6144, 256, 8
    with compiling() as done:
        moe_fused_triton.gate_up_act(torch.randn(1, hid).to(torch.bfloat16), _stacked(g, 2 * inter, hid, experts), _fp8(g, 2 * inter, hid),
                                     torch.tensor([[3, 1, 2, 4, 5, 6, 7, 0, -1]]), shared_last=True)
    (up,) = done
    assert up["constexprs"]["BLOCK_N"] == moe_fused_triton.TUNE["up_block_n_fp8_few"]
    assert up["constexprs"]["BLOCK_K"] == moe_fused_triton.TUNE["up_block_k_fp8_few"]
    info = ptxas_info(up["ptx"])
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info
