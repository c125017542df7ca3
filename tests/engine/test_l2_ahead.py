"""L2 look-ahead (tilepd/engine/l2_ahead.py): the regions' byte windows, the pieces each program of a host takes (under
Triton's interpreter: every byte of a region exactly once), the host kernels compiled for sm_90 with the bulk
prefetch (tests/engine/sm90_compile.py: Triton's own ptxas, no GPU), and the MoE block handing its gate the shared
expert. Whether the prefetch makes the step faster is the device's to say (bench/depth_step.sh ab, docs/PERFORMANCE.md);
it never changes a result (no register is written, nothing waits on it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")


def test_regions_give_consecutive_row_windows_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilepd.engine import l2_ahead
    from tilepd.model_format.block_fp8 import quantize

    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset())
    w = quantize(torch.randn(256, 1024), (128, 128))
    assert l2_ahead.regions(w, ("split", "merge")) == {}  # off: nothing computed
    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset({"split", "merge"}))
    got = l2_ahead.regions(w, ("split", "merge"), budget=64 << 10)  # 256 rows of 1024 bytes, 64 KiB a host: 256 bytes a row each
    assert set(got) == {"split", "merge"}
    assert (got["split"].rows, got["split"].row_bytes, got["split"].stride, got["split"].skip) == (256, 256, 1024, 0)
    assert (got["merge"].rows, got["merge"].row_bytes, got["merge"].skip) == (256, 256, 256)
    assert got["split"].base.data_ptr() == w.weight.data_ptr()
    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset({"merge"}))  # merge alone takes the first bytes
    assert l2_ahead.regions(w, ("split", "merge"), budget=64 << 10)["merge"].skip == 0
    whole = l2_ahead.regions(w, ("merge",), budget=1 << 20)["merge"]  # fits: one contiguous range
    assert (whole.rows, whole.row_bytes) == (1, 256 * 1024)
    assert l2_ahead.regions(w, ("merge",), budget=16 << 10) == {}  # 64 bytes a row: under a cache line, left out
    dense = torch.randn(4, 32, 64).to(torch.bfloat16)  # W_UV's [H, v, rank] layout
    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset({"prepare"}))
    r = l2_ahead.regions(dense, ("prepare",), budget=1 << 20)["prepare"]
    assert (r.rows, r.row_bytes) == (1, dense.numel() * 2)
    big = torch.zeros(64, 2048, dtype=torch.bfloat16)
    assert l2_ahead.regions(big[:, 4:], ("prepare",), budget=1 << 20) == {}  # 8 bytes off the 16-byte grid: refused


def test_plan_keeps_one_prefetch_a_thread() -> None:
    from tilepd.engine import l2_ahead

    base = torch.zeros(1, 16, dtype=torch.uint8)
    assert l2_ahead.plan(l2_ahead.Region(base, 1, 16 << 20, 16 << 20), 512, 4) == (1, 16384)  # 1024 pieces over 65536 threads
    assert l2_ahead.plan(l2_ahead.Region(base, 1, 16 << 20, 16 << 20), 2, 1) == (1, 1 << 18)  # 64 threads: 256 KiB pieces
    assert l2_ahead.plan(l2_ahead.Region(base, 6144, 2048, 16384), 128, 8) == (6144, 16384)
    assert l2_ahead.plan(l2_ahead.Region(base, 6144, 2048, 16384), 8, 4) == (1024, 16384)  # rows past one a thread: cut


def test_bad_switch_values_are_refused_by_name() -> None:
    for env, needle in (({"TILEPD_L2_AHEAD": "gate,nonsense"}, "TILEPD_L2_AHEAD='gate,nonsense'"),
                        ({"TILEPD_L2_AHEAD_CHUNK": "100"}, "TILEPD_L2_AHEAD_CHUNK=100"), ({"TILEPD_L2_AHEAD_MB": "4096"}, "TILEPD_L2_AHEAD_MB=4096")):
        res = subprocess.run([sys.executable, "-c", "import tilepd.engine.l2_ahead"], env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode != 0 and needle in res.stderr, res.stderr[-1000:]
    for raw, want in (("all", "['attn', 'attn_merge', 'g1', 'g2', 'gate', 'merge', 'prepare', 'split']"), ("split+merge", "['merge', 'split']"),
                      ("", "[]")):
        res = subprocess.run([sys.executable, "-c", "from tilepd.engine import l2_ahead as a; print(sorted(a.SWITCH['hosts']))"],
                             env={**os.environ, "TILEPD_L2_AHEAD": raw}, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and want in res.stdout, (raw, res.stdout, res.stderr[-1000:])


_ITEMS = textwrap.dedent("""
    import torch, triton, triton.language as tl
    from tilepd.engine import l2_ahead

    @triton.jit
    def probe(OFF, SIZE, OK, rows, row_bytes, stride, CHUNK: tl.constexpr, NT: tl.constexpr):
        lin = tl.program_id(0)
        offs, size, ok = l2_ahead.items(rows, row_bytes, stride, lin, tl.num_programs(0), CHUNK, NT)
        e = tl.arange(0, NT)
        tl.store(OFF + lin * NT + e, offs)
        tl.store(SIZE + lin * NT + e, size)
        tl.store(OK + lin * NT + e, ok.to(tl.int32))

    base = torch.zeros(1, 16, dtype=torch.uint8)
    n = 0
    for rows, row_bytes, stride, programs, warps in ((1, 1 << 20, 1 << 20, 3, 1), (100, 2048, 4096, 4, 1), (6144, 2944, 6144, 64, 2),
                                                     (7, 400, 1024, 5, 1), (1, 4 << 20, 4 << 20, 2, 1)):
        region = l2_ahead.Region(base, rows, row_bytes, stride)
        rows_, chunk = l2_ahead.plan(region, programs, warps)
        nt = 32 * warps
        off = torch.zeros(programs, nt, dtype=torch.int64)
        size = torch.zeros(programs, nt, dtype=torch.int32)
        ok = torch.zeros(programs, nt, dtype=torch.int32)
        probe[(programs,)](off, size, ok, rows_, row_bytes, stride, CHUNK=chunk, NT=nt)
        pieces = sorted((int(o), int(s)) for o, s, k in zip(off.flatten(), size.flatten(), ok.flatten()) if k)
        want = [(r * stride, row_bytes) for r in range(rows_)]
        merged = []
        for o, s in pieces:
            assert 0 < s <= chunk and s % 16 == 0 and o % 16 == 0, (o, s, chunk)
            if merged and merged[-1][0] + merged[-1][1] == o and o % stride:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        assert merged == want, (rows, row_bytes, stride, programs, merged[:4], want[:4])
        n += 1
    print("items ok", n)
""")


def test_each_program_takes_its_own_pieces_and_together_they_cover_the_region(repo_root: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _ITEMS], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "items ok 5" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def _switched_on(monkeypatch: pytest.MonkeyPatch, evict_last: int = 0) -> None:
    from tilepd.engine import l2_ahead

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(l2_ahead, "_enabled", lambda t: True)
    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset(l2_ahead.HOSTS))
    monkeypatch.setitem(l2_ahead.SWITCH, "evict_last", evict_last)


@pytest.mark.skipif(os.environ.get("TILEPD_SKIP_SM90_COMPILE") == "1", reason="TILEPD_SKIP_SM90_COMPILE=1")
@pytest.mark.parametrize("evict_last", [0, 1], ids=["evict-normal", "evict-last"])
def test_hosts_compile_for_sm90_with_one_bulk_prefetch_a_thread(monkeypatch: pytest.MonkeyPatch, evict_last: int) -> None:
    from tests.engine.sm90_compile import compiling
    from tilepd.engine import fp8_triton, l2_ahead, mla_attention, mla_fused_triton, moe_fused_triton
    from tilepd.model_format.block_fp8 import quantize

    _switched_on(monkeypatch, evict_last)
    bf = torch.bfloat16
    weight = torch.zeros(512, 1024, dtype=torch.float8_e4m3fn)
    region = l2_ahead.regions(weight, ("prepare",), budget=1 << 20)["prepare"]
    t, h, heads, nope, rank, rope = 1, 256, 4, 32, 64, 16
    x = torch.randn(t, h).to(bf)
    cs = torch.randn(t, 2, rope).to(bf)
    cache = torch.zeros(8, 1, rank + rope, dtype=bf)
    g1 = quantize(torch.randn(384, h), (128, 128))
    with compiling() as done:
        fp8_triton.launch_fused(x, g1.weight, g1.scale, g1.block, norm_weight=torch.ones(h, dtype=bf), eps=1e-6, l2_host="g1", l2_region=region)
        mla_fused_triton.prepare(torch.randn(t, heads * (nope + rope)).to(bf), torch.randn(t, rank + rope).to(bf), torch.randn(heads, nope, rank).to(bf),
                                 torch.ones(rank, dtype=bf), 1e-6, cs, torch.zeros(t, dtype=torch.int64), cache, rank, rope, False, l2_region=region)
        qc = torch.randn(t, heads, rank + rope).to(bf)
        part, lse = mla_attention.split_partials(qc, cache, rank, 0.1, 8, lo=torch.zeros(t, dtype=torch.int64), hi=torch.zeros(t, dtype=torch.int64),
                                                 l2_region=region)
        mla_fused_triton.merge_uv(part, lse, torch.randn(heads, 32, rank).to(bf), bf, bf, l2_region=region)
        moe_fused_triton.gate_route(x, torch.ones(h, dtype=bf), 1e-6, torch.randn(256, h), torch.zeros(256), 8, 4, 8, True, 2.5, l2_region=region)
        from tilepd.engine.attention import split_kv_attention  # Llama's (imports Triton at the top: CUDA installs only)

        kv = torch.zeros(64, 2, 2 * 64, dtype=bf)
        split_kv_attention(torch.randn(1, 8, 64).to(bf), kv[..., :64], kv[..., 64:], torch.zeros(4, 64, dtype=bf), 0.125,
                           l2={"attn": region, "attn_merge": region})
    assert {d["name"] for d in done} == {"_fp8_gemv_kernel", "_prepare_kernel", "_mla_split_kernel", "_merge_uv_kernel", "_gate_kernel",
                                         "_split_kernel", "_merge_kernel"}
    for d in done:
        assert d["constexprs"]["AH"] == 1 and d["constexprs"]["AH_EVICT"] == evict_last, d["name"]
        assert d["ptx"].count("cp.async.bulk.prefetch.L2.global") == 1, (d["name"], d["ptx"].count("cp.async.bulk.prefetch.L2.global"))
        assert ("createpolicy.fractional.L2::evict_last" in d["ptx"]) == bool(evict_last), d["name"]


def test_off_on_cpu_and_without_a_region(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilepd.engine import l2_ahead

    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset(l2_ahead.HOSTS))
    x = torch.zeros(4)
    region = l2_ahead.Region(torch.zeros(1, 256, dtype=torch.uint8), 1, 256, 256)
    assert l2_ahead.launch_args("split", region, x, 4, 4)["AH"] == 0  # a CPU tensor
    monkeypatch.setattr(l2_ahead, "_enabled", lambda t: True)
    assert l2_ahead.launch_args("split", None, x, 4, 4)["AH"] == 0
    assert l2_ahead.launch_args("split", region, x, 4, 4)["AH"] == 1
    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset({"gate"}))
    assert l2_ahead.launch_args("split", region, x, 4, 4)["AH"] == 0


@pytest.mark.skipif(os.environ.get("TILEPD_SKIP_SM90_COMPILE") == "1", reason="TILEPD_SKIP_SM90_COMPILE=1")
def test_the_moe_block_hands_its_gate_the_shared_experts_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.engine.sm90_compile import compiling
    from tilepd.engine import l2_ahead, moe_fused
    from tilepd.model_format.block_fp8 import BlockFp8, quantize

    _switched_on(monkeypatch)
    seen: list[tuple[str, l2_ahead.Region | None]] = []
    real = l2_ahead.launch_args
    monkeypatch.setattr(l2_ahead, "launch_args", lambda kind, region, *a: seen.append((kind, region)) or real(kind, region, *a))
    g = torch.Generator().manual_seed(0)
    hidden, inter, experts = 256, 128, 8

    def fp8(n: int, k: int) -> BlockFp8:
        return quantize(torch.randn(n, k, generator=g), (128, 128))

    def stacked(n: int, k: int) -> BlockFp8:
        parts = [fp8(n, k) for _ in range(experts)]
        return BlockFp8(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), (128, 128))

    w = {"l.mlp_norm": torch.ones(hidden, dtype=torch.bfloat16), "l.gate": torch.randn(experts, hidden), "l.gate_bias": torch.zeros(experts),
         "l.experts_w13": stacked(2 * inter, hidden), "l.experts_w2": stacked(hidden, inter), "l.shared_w13": fp8(2 * inter, hidden),
         "l.shared_w2": fp8(hidden, inter)}
    spec = SimpleNamespace(n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # moe_fused.applies takes CPU tensors only under the interpreter
    assert moe_fused.applies(torch.zeros(1, hidden, dtype=torch.bfloat16), w, "l.", spec)
    monkeypatch.delenv("TRITON_INTERPRET")
    with compiling() as done:
        moe_fused.moe_block(torch.randn(1, hidden).to(torch.bfloat16), w, "l.", spec)
    gate = [d for d in done if d["name"] == "_gate_kernel"]
    assert gate and gate[0]["constexprs"]["AH"] == 1
    regions = dict(seen)
    assert regions["gate"] is not None and regions["gate"].base.data_ptr() == w["l.shared_w13"].weight.data_ptr()


def test_llama_hands_its_attention_the_output_projection(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    """Llama's attention between its compiled halves (post_attn set, as compiled.accelerate leaves it) gets l2_ahead's
    regions of each layer's wo for its two launches (on a CPU the attention is torch's and the regions go unused)."""
    from tilepd.engine import l2_ahead, llama
    from tilepd.engine.engine import load_engine

    monkeypatch.setitem(l2_ahead.SWITCH, "hosts", frozenset(l2_ahead.HOSTS))
    eng = load_engine(str(tiny_llama), device="cpu", max_seq_len=32, dtype="float32")
    model = eng.model
    model.post_attn = llama.post_attn  # the uncompiled form of what accelerate's compile leaves between the halves
    seen: list[dict] = []
    real = llama.cached_attention
    monkeypatch.setattr(llama, "cached_attention", lambda *a, l2=None, **k: seen.append(l2) or real(*a, **k))
    with torch.no_grad():
        model.forward(torch.tensor([1, 2]), torch.tensor([0, 1]), 8)
    wos = [lw[5] for lw in model.layer_weights]
    assert len(seen) == len(wos)
    for regions, wo in zip(seen, wos):
        assert set(regions) <= {"attn", "attn_merge"} and regions["attn"].base.data_ptr() == wo.data_ptr(), regions
