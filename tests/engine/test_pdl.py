"""Programmatic dependent launch (tilepd/engine/pdl.py): the switch's rules on CPU, and every kernel of the fused decode
step compiled for sm_90 with it on (tests/engine/sm90_compile.py: Triton's own ptxas, no GPU), each with its
griddepcontrol.wait (and the L2 prefetch of its weights where the kernel has one). The interpreter never runs that
form; whether the kernels stay exact with it on is bench/*_gpu.py's and the GPU parity tests' (pytest -m gpu)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")


def test_off_on_cpu_and_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilepd.engine import pdl

    monkeypatch.setitem(pdl.SWITCH, "on", 1)
    monkeypatch.setitem(pdl.SWITCH, "prefetch", 1)
    x = torch.zeros(2)
    assert not pdl.enabled(x) and pdl.launch_args(x) == {"PDL": 0} and not pdl.prefetch_flag(x) and pdl.flag(x) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(x)


def test_flag_forms_and_skipped_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """flag: 1 wait + early trigger, 2 wait only, 0 for a skipped kind; an unknown kind in TILEPD_PDL_SKIP is refused."""
    import subprocess
    import sys

    from tilepd.engine import pdl

    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    x = torch.zeros(2)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(pdl.SWITCH, "on", 1)
    monkeypatch.setitem(pdl.SWITCH, "skip", frozenset({"down"}))
    monkeypatch.setitem(pdl.SWITCH, "early", frozenset())
    monkeypatch.setitem(pdl.SWITCH, "trigger", 1)
    assert pdl.flag(x, "gate") == 1 and pdl.launch_args(x, "gate") == {"PDL": 1, "launch_pdl": True}
    assert pdl.flag(x, "down") == 0 and pdl.launch_args(x, "down") == {"PDL": 0}
    monkeypatch.setitem(pdl.SWITCH, "trigger", 0)
    assert pdl.flag(x, "gate") == 2
    monkeypatch.setitem(pdl.SWITCH, "trigger", 2)
    assert pdl.flag(x, "gate") == 3 and pdl.launch_args(x, "gate") == {"PDL": 3, "launch_pdl": True}
    monkeypatch.setitem(pdl.SWITCH, "early", frozenset({"route", "g1"}))  # sites that trigger early in any form
    monkeypatch.setitem(pdl.SWITCH, "prefetch_at", frozenset({"wo"}))
    assert pdl.flag(x, "gate", "route") == 1 and pdl.flag(x, "gate") == 3 and pdl.flag(x, site="g1") == 1 and pdl.flag(x, site="g2") == 3
    assert pdl.launch_args(x, "gate", "route") == {"PDL": 1, "launch_pdl": True} and pdl.flag(x, "down", "down") == 0
    monkeypatch.setitem(pdl.SWITCH, "prefetch", 0)
    assert pdl.prefetch_flag(x, site="wo") and not pdl.prefetch_flag(x, site="g1") and not pdl.prefetch_flag(x)
    monkeypatch.setitem(pdl.SWITCH, "preload_at", frozenset({"g2"}))  # the register preload: its own sites, prefetch's switch not read
    monkeypatch.setitem(pdl.SWITCH, "prefetch", 1)
    assert pdl.preload_flag(x, site="g2") and not pdl.preload_flag(x, site="wo") and not pdl.preload_flag(x)
    monkeypatch.setitem(pdl.SWITCH, "prefetch", 0)
    monkeypatch.setitem(pdl.SWITCH, "on", 0)
    assert pdl.flag(x, "gate") == 0 and pdl.flag(x, "gate", "route") == 0 and not pdl.prefetch_flag(x, site="wo")
    assert not pdl.preload_flag(x, site="g2")
    for name in ("TILEPD_PDL_EARLY", "TILEPD_PDL_PREFETCH_AT", "TILEPD_PDL_PRELOAD_AT"):
        res = subprocess.run([sys.executable, "-c", "import tilepd.engine.pdl"], env={**os.environ, name: "g1,g7"}, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode != 0 and f"{name}='g1,g7'" in res.stderr, res.stderr
    res = subprocess.run([sys.executable, "-c", "from tilepd.engine import pdl; print(sorted(pdl.SWITCH['early']))"],
                         env={**os.environ, "TILEPD_PDL_EARLY": "route+merge,g1"}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "['g1', 'merge', 'route']", res.stdout + res.stderr
    env = {**os.environ, "TILEPD_PDL_SKIP": "gate,nonsense"}
    res = subprocess.run([sys.executable, "-c", "import tilepd.engine.pdl"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "TILEPD_PDL_SKIP='gate,nonsense'" in res.stderr
    res = subprocess.run([sys.executable, "-c", "import tilepd.engine.pdl"], env={**os.environ, "TILEPD_PDL_TRIGGER": "3"}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0 and "TILEPD_PDL_TRIGGER=3" in res.stderr
    bare = {k: v for k, v in os.environ.items() if not k.startswith("TILEPD_PDL")}  # the defaults: the late form, no prefetch
    res = subprocess.run([sys.executable, "-c", "from tilepd.engine import pdl; s = pdl.SWITCH; print(s['on'], s['trigger'], s['prefetch'], "
                          "'+'.join(sorted(s['early'])), len(s['prefetch_at']), len(s['preload_at']))"], env=bare, capture_output=True, text=True, timeout=120)
    # the defaults: the late form, with the early trigger at the sites before a GEMV of many programs or a small kernel
    assert res.returncode == 0 and res.stdout.split() == ["1", "2", "0", "down+g1+gate+gate_up+merge+route+wo", "0", "3"], res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-c", "from tilepd.engine import pdl; print(len(pdl.SWITCH['early']))"], env={**bare, "TILEPD_PDL_EARLY": ""},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "0", res.stdout + res.stderr  # set, even empty, the variable wins


def test_shard_form_sets_only_the_switches_the_environment_leaves_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within shard_form: on, trigger and prefetch 1 unless their variable is set (TILEPD_PDL_PREFETCH=0 keeps the
    prefetch off); after, and when not active, SWITCH is what it was."""
    from tilepd.engine import pdl

    for name, _ in pdl.SHARD_FORM.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pdl, "SWITCH", {"on": 0, "trigger": 0, "prefetch": 0, "skip": frozenset({"down"})})
    before = dict(pdl.SWITCH)
    with pdl.shard_form():
        assert pdl.SWITCH == {"on": 1, "trigger": 1, "prefetch": 1, "skip": frozenset({"down"})}
    assert pdl.SWITCH == before
    with pdl.shard_form(active=False):
        assert pdl.SWITCH == before
    monkeypatch.setenv("TILEPD_PDL_PREFETCH", "0")
    with pytest.raises(RuntimeError, match="inside"), pdl.shard_form():
        assert pdl.SWITCH["on"] == 1 and pdl.SWITCH["trigger"] == 1 and pdl.SWITCH["prefetch"] == 0
        raise RuntimeError("inside")  # restored on the way out of an error too
    assert pdl.SWITCH == before


def test_a_tp_rank_steps_in_the_shard_form_and_one_rank_alone_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """TPDeepseekV3Model.forward runs the base step (and so every graph captured through it) inside pdl.shard_form
    when its group has more than one rank."""
    from tilepd.engine import pdl
    from tilepd.engine.deepseek_v3 import DeepseekV3Model
    from tilepd.engine.tp import NoCollectiveGroup, TPDeepseekV3Model

    for name, _ in pdl.SHARD_FORM.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pdl, "SWITCH", {"on": 0, "trigger": 0, "prefetch": 0, "skip": frozenset()})
    seen = []
    monkeypatch.setattr(DeepseekV3Model, "forward", lambda self, tokens, positions, attn_len: seen.append(dict(pdl.SWITCH)) or (tokens, None))
    for size in (8, 1):
        model = object.__new__(TPDeepseekV3Model)  # the step's wrapper alone: no weights needed
        model.tp = NoCollectiveGroup(0, size)
        model.forward(torch.zeros(1), torch.zeros(1), 4)
    assert [(s["on"], s["trigger"], s["prefetch"]) for s in seen] == [(1, 1, 1), (0, 0, 0)]
    assert pdl.SWITCH["on"] == 0


def _compile_step_kernels(monkeypatch: pytest.MonkeyPatch, trigger: int = 1) -> list[dict]:
    from tests.engine.sm90_compile import compiling
    from tilepd.engine import (dsa_indexer, dsa_topk, fp8_triton, gemv_triton, mla_attention, mla_fused_triton, moe_fused_triton, pdl)
    from tilepd.model_format.block_fp8 import BlockFp8, quantize

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "enabled", lambda t, kind="gemv": True)
    monkeypatch.setitem(pdl.SWITCH, "trigger", trigger)  # 1, the widest form: early trigger, weights prefetched before the wait
    monkeypatch.setitem(pdl.SWITCH, "early", frozenset())  # every kernel in the form `trigger` names
    monkeypatch.setitem(pdl.SWITCH, "prefetch", 1)
    monkeypatch.setitem(pdl.SWITCH, "preload_at", frozenset({"gemv"}))  # the fp8 GEMV's first chunk into registers before the wait
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def fp8(n: int, k: int) -> BlockFp8:
        return quantize(torch.randn(n, k, generator=g), (128, 128))

    def stacked(e: int, n: int, k: int) -> BlockFp8:
        parts = [fp8(n, k) for _ in range(e)]
        return BlockFp8(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), (128, 128))

    h, t = 256, 1
    x = torch.randn(t, h).to(bf)
    with compiling() as done:
        w = fp8(384, h)
        fp8_triton.launch_fused(x, w.weight, w.scale, w.block, norm_weight=torch.ones(h, dtype=bf), eps=1e-6, residual=torch.zeros(t, 384, dtype=bf))
        gemv_triton.launch(x, torch.randn(384, h).to(bf), torch.ones(h, dtype=bf), 1e-6, "norm", None, chain=True)
        heads, nope, rank, rope = 4, 32, 64, 16
        q = torch.randn(t, heads * (nope + rope)).to(bf)
        cache = torch.zeros(8, 1, rank + rope, dtype=bf)
        cs = torch.randn(t, 2, rope).to(bf)
        icache = torch.zeros(8, 32, dtype=bf)
        index = (torch.randn(t, 32).to(bf), torch.ones(32, dtype=bf), torch.zeros(32, dtype=bf), cs, icache, False)
        mla_fused_triton.prepare(q, torch.randn(t, rank + rope).to(bf), torch.randn(heads, nope, rank).to(bf), torch.ones(rank, dtype=bf), 1e-6, cs,
                                 torch.zeros(t, dtype=torch.int64), cache, rank, rope, False, index,
                                 (x, torch.ones(h, dtype=bf), 1e-6, torch.randn(4, h).to(bf)))
        qc = torch.randn(t, heads, rank + rope).to(bf)
        part, lse = mla_attention.split_partials(qc, cache, rank, 0.1, 8, lo=torch.zeros(t, dtype=torch.int64), hi=torch.zeros(t, dtype=torch.int64))
        mla_attention.split_partials(qc, cache, rank, 0.1, 8, idx=torch.zeros(t, 8, dtype=torch.int64), ok=torch.ones(t, 8, dtype=torch.bool))
        mla_fused_triton.merge_uv(part, lse, torch.randn(heads, 32, rank).to(bf), bf, bf)
        for n_group, topk_group, apart in ((1, 1, 1), (8, 4, 1), (8, 4, 0)):  # routed by route_triton's kernel (default) / the last program
            monkeypatch.setitem(moe_fused_triton.TUNE, "route_apart", apart)
            hn, ids, wts, _ = moe_fused_triton.gate_route(x, torch.ones(h, dtype=bf), 1e-6, torch.randn(256, h), torch.zeros(256), n_group, topk_group,
                                                          8, True, 2.5)
        ids = torch.tensor([[3, 1, -1]])
        wts = torch.ones(1, 3, dtype=bf)
        a = moe_fused_triton.gate_up_act(x, stacked(4, 256, h), fp8(256, h), ids, shared_last=True)
        moe_fused_triton.down_combine(torch.randn(3, 128).to(bf), stacked(4, h, 128), fp8(h, 128), ids, wts, x, shared_last=True)
        moe_fused_triton.gate_up_act(x, torch.randn(4, 256, h).to(bf), torch.randn(256, h).to(bf), ids, shared_last=True)
        del a
        length = 4096
        valid = torch.ones(t, length, dtype=torch.bool)
        hist = dsa_topk.new_hist(t, torch.device("cpu"))
        scores = dsa_indexer.index_scores(torch.randn(t, 4, 32).to(bf), cs, torch.ones(t, 4), torch.zeros(length, 32, dtype=bf), valid, rope, False,
                                          hist=hist)
        for fused in (1, 0):  # the finish in the refine's last program (the default), then as its own launch
            monkeypatch.setitem(dsa_topk.TUNE, "fused_finish", fused)
            dsa_topk.topk_select(scores, valid, 2048, hist=hist.clone())
        dsa_topk.topk_select(torch.zeros(t, 2048 + 64), torch.ones(t, 2048 + 64, dtype=torch.bool), 2048)
    return done


@pytest.mark.skipif(os.environ.get("TILEPD_SKIP_SM90_COMPILE") == "1", reason="TILEPD_SKIP_SM90_COMPILE=1")
def test_step_kernels_compile_for_sm90_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    done = _compile_step_kernels(monkeypatch)
    names = {d["name"] for d in done}
    expected = {"_fp8_gemv_kernel", "_dense_gemv_kernel", "_prepare_kernel", "_mla_split_kernel", "_merge_uv_kernel", "_gate_kernel",
                "_route_kernel", "_gate_up_kernel", "_down_kernel", "_index_scores_kernel", "_topk_split_kernel", "_topk_refine_kernel", "_topk_finish_kernel",
                "_topk_one_program_kernel"}
    assert expected <= names, expected - names
    for d in done:
        assert d["options"].get("launch_pdl") is True, d["name"]
        assert "griddepcontrol.wait" in d["ptx"] and "griddepcontrol.launch_dependents" in d["ptx"], d["name"]
        if d["constexprs"].get("PREFETCH"):
            assert "prefetch.global.L2" in d["ptx"], d["name"]
        if d["constexprs"].get("PRELOAD_K"):  # weight loads issued before the wait, kept there
            assert "ld.global" in d["ptx"][: d["ptx"].index("griddepcontrol.wait")], d["name"]
    assert {d["name"] for d in done if d["constexprs"].get("PRELOAD_K")} == {"_fp8_gemv_kernel"}
    prefetching = {d["name"] for d in done if d["constexprs"].get("PREFETCH")}
    assert {"_fp8_gemv_kernel", "_dense_gemv_kernel", "_prepare_kernel", "_merge_uv_kernel", "_gate_up_kernel", "_down_kernel"} <= prefetching


@pytest.mark.skipif(os.environ.get("TILEPD_SKIP_SM90_COMPILE") == "1", reason="TILEPD_SKIP_SM90_COMPILE=1")
def test_the_late_form_triggers_after_each_kernels_last_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """TILEPD_PDL_TRIGGER=2: every kernel of the step waits before its reads and triggers once, after the last store
    or atomic in its PTX (the late form, pdl.trigger as each program's last statement), never right after the wait."""
    import re

    done = _compile_step_kernels(monkeypatch, trigger=2)
    assert len({d["name"] for d in done}) >= 14
    for d in done:
        ptx = d["ptx"]
        assert d["constexprs"]["PDL"] == 3, d["name"]
        assert ptx.count("griddepcontrol.launch_dependents") == 1, d["name"]
        last_write = max(m.start() for m in re.finditer(r"\b(st|atom|red)\.global", ptx))
        assert ptx.index("griddepcontrol.launch_dependents") > last_write > ptx.index("griddepcontrol.wait"), d["name"]
