"""bench/tp_shard_step.py: one TP8 rank's shard with no-op collectives (tp.NoCollectiveGroup), on CPU tiny shapes, so
the H200 benchmark cannot rot; and GLM-5.1's real TP8 shard shapes on 128x128 fp8 blocks (shapes only, nothing built)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tilepd.model_format.block_fp8 import DEFAULT_BLOCK, BlockFp8
from tilepd.model_format.model_spec import spec_from_hf_config
from tilepd.engine.tp import NoCollectiveGroup, build_tp_model, local_spec

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tp_shard_step.py"
sys.path.insert(0, str(BENCH.parent))  # the bench imports its folder's kit, as when it runs as a script


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tp_shard_step", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_collective_group_keeps_the_real_shapes() -> None:
    g = NoCollectiveGroup(0, 8)
    x = torch.arange(6.0).view(2, 3)
    assert g.all_reduce(x) is x
    full = g.all_gather_last(x)
    assert full.shape == (2, 24) and torch.equal(full[:, 9:12], x)


def test_tiny_shard_step_gives_full_vocab_logits_over_an_eighth_of_the_heads(bench) -> None:
    """The bench's own builder: rank 0's TP8 shard (fp8, convert-weights' sharding) and its no-op group's step."""
    cfg = bench.TINY_GLM51
    spec = spec_from_hf_config(cfg)
    built_n = spec.first_k_dense_replace + 1
    weights, blocks = bench.shard_weights(spec_from_hf_config({**cfg, "num_hidden_layers": built_n}), torch.device("cpu"),
                                          torch.float32, 0, 8, fp8=True)
    bench.deepen(weights, built_n, spec.num_layers, alias=False)
    model = build_tp_model(spec, weights, 64, torch.device("cpu"), torch.float32, NoCollectiveGroup(0, 8))
    v, n = spec.vocab_size, spec.vocab_size // 8
    assert weights["lm_head"].shape[0] == n  # the head is vocab-parallel: the full width comes from the (no-op) gather
    assert model.spec.num_heads == spec.num_heads // 8 == 1
    assert weights["layers.4.w_uk"].shape[0] == 1 and weights["layers.4.wq_b"].shape[0] == spec.qk_nope_head_dim + spec.qk_rope_head_dim
    assert isinstance(weights["layers.4.experts_w13"], BlockFp8) and weights["layers.4.experts_w13"].weight.shape[1] == 2 * 1024 // 8
    assert weights["layers.4.experts_w13"].weight.data_ptr() != weights["layers.3.experts_w13"].weight.data_ptr()  # own copy
    with torch.no_grad():
        logits, _ = model.forward(torch.tensor([3]), torch.tensor([0]), 16)
    assert logits.shape == (1, v) and torch.isfinite(logits).all()
    assert torch.equal(logits[:, :n], logits[:, n:2 * n])  # the other ranks' slots repeat this rank's
    assert blocks["layers.3.experts_w2"] == DEFAULT_BLOCK and blocks["layers.3.wq_b"] == (1, DEFAULT_BLOCK[1])  # 32 rows: per-row


_FUSED_MOE_ON_A_SHARD = textwrap.dedent("""
    import importlib.util, sys, torch
    sys.path.insert(0, sys.argv[1])
    device = torch.device(sys.argv[2])
    spec_ = importlib.util.spec_from_file_location("tp_shard_step", sys.argv[1] + "/tp_shard_step.py")
    bench = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(bench)
    from tilepd.engine import moe, moe_fused
    from tilepd.engine.tp import NoCollectiveGroup, build_tp_model
    from tilepd.model_format.model_spec import spec_from_hf_config
    torch.set_num_threads(1)
    spec = spec_from_hf_config(bench.TINY_GLM51)
    built = spec.first_k_dense_replace + 1
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    weights, _ = bench.shard_weights(spec_from_hf_config({**bench.TINY_GLM51, "num_hidden_layers": built}), device, dtype, 0, 8, fp8=True)
    bench.deepen(weights, built, spec.num_layers, alias=False)
    model = build_tp_model(spec, weights, 64, device, dtype, NoCollectiveGroup(0, 8))
    moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "triton", "triton"
    calls, real = [], moe_fused.moe_block
    def spy(*a, **k):
        calls.append(k.get("residual", True))
        return real(*a, **k)
    moe_fused.moe_block = spy
    out = {}
    for impl in ("torch", "triton"):
        moe.BLOCK_IMPL["moe"] = impl
        with torch.no_grad():
            out[impl], _ = model.forward(torch.tensor([3, 7], device=device), torch.tensor([0, 1], device=device), 16)
    n_moe = spec.num_layers - spec.first_k_dense_replace
    assert calls == [True] * n_moe, calls  # every MoE layer through the fused block, rank 0 adding the residual in it
    err = float((out["triton"] - out["torch"]).abs().max() / out["torch"].abs().max())
    assert err < (1e-3 if dtype == torch.float32 else 3e-2), err
    print("tp fused moe ok", n_moe, err)
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")
def test_a_tp8_shard_runs_its_moe_layers_through_the_fused_block(repo_root: Path) -> None:
    """TPDeepseekV3Model's MoE half on the speed path: the fused block (4 launches) over this rank's expert slices, its
    output all-reduced before the residual add, as the unfused ops compute it (Triton's interpreter on CPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _FUSED_MOE_ON_A_SHARD, str(BENCH.parent), "cpu"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and "tp fused moe ok 2" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.gpu
def test_a_tp8_shard_runs_its_moe_layers_through_the_fused_block_on_the_gpu(repo_root: Path) -> None:
    """The same on the device, in bf16 (the compiled kernels, not the interpreter): bench/steps.sh's parity step runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(repo_root), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("TRITON_INTERPRET", None)  # (the device's packages may come on PYTHONPATH: kept behind the checkout)
    r = subprocess.run([sys.executable, "-c", _FUSED_MOE_ON_A_SHARD, str(BENCH.parent), "cuda"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and "tp fused moe ok 2" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_glm51_tp8_shard_is_whole_128_blocks_and_an_eighth_of_the_heads(bench) -> None:
    """GLM-5.1's own shapes at TP 8 (what the H200 run builds): every fp8 tensor keeps 128x128 blocks, as
    convert-weights --tp 8 --dtype fp8 plans them (no per-row fallback, no refused column shard)."""
    from tilepd.dev.synthetic import hf_tensor_shapes
    from tilepd.weights import fp8_build
    from tilepd.weights.out_tensors import family_layout

    spec = spec_from_hf_config(bench.GLM51)
    assert (spec.num_layers, spec.first_k_dense_replace, spec.vocab_size, spec.num_heads) == (78, 3, 154880, 64)
    assert local_spec(spec, 8).num_heads == 8
    built = spec_from_hf_config({**bench.GLM51, "num_hidden_layers": 4})
    shapes = hf_tensor_shapes(built)
    planned = {t.name: fp8_build.block_and_scale_shape(t, lambda p: shapes[p], 8, DEFAULT_BLOCK)[0]
               for t in family_layout(built, set()) if fp8_build.stores_fp8(t, lambda p: False, True, False)}
    assert "layers.3.experts_w2" in planned and "layers.0.w2" in planned
    assert {b for b in planned.values()} == {DEFAULT_BLOCK}


@pytest.mark.slow
def test_tp_shard_step_cpu_path(python_exe: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TILEPD_PDL", "TILEPD_PDL_TRIGGER")} | {"OMP_NUM_THREADS": "1", "TILEPD_PDL_PREFETCH": "0"}
    out = subprocess.run([python_exe, str(BENCH), "--device", "cpu", "--tiny", "--json"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["collectives"].startswith("NO-OPS") and r["tp"] == 8 and r["layers"] == 5
    assert r["pdl"] == {"on": 1, "trigger": 1, "prefetch": 0}  # the rank's shard form, but for what the environment sets
    assert r["heads"] == {"model": 8, "shard": 1} and r["shard_spec"]["num_heads"] == 1
    assert r["vocab"] == {"model": 1024, "shard_rows": 128, "logits_width": 1024}
    assert r["fp8"]["block"] == [128, 128] and r["fp8"]["per_row_scales"] == ["wq_b"]
    assert [row["context"] for row in r["rows"]] == [32, 64]
    for row in r["rows"]:
        assert "error" not in row, row
        assert row["ms_per_step"] > 0 and row["floor_ms"] > 0 and 0 < row["pct_of_floor"]
        assert row["us_per_layer"] == pytest.approx(row["ms_per_step"] * 1e3 / 5)
        assert row["kv_GB"] * 1e9 == pytest.approx(5 * (min(16, row["context"]) * 80 + row["context"] * 32) * 4)  # DSA: topk rows + all keys


_TWO_RANKS = textwrap.dedent("""
    import importlib.util, os, sys, torch, torch.distributed as dist
    bench_dir, rank, size, init, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    sys.path.insert(0, bench_dir)
    spec_ = importlib.util.spec_from_file_location("tp_shard_step", bench_dir + "/tp_shard_step.py")
    bench = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(bench)
    from tilepd.engine import deepseek_v3, mla_fused, moe, moe_fused
    from tilepd.engine.tp import TPGroup, build_tp_model
    from tilepd.model_format.model_spec import spec_from_hf_config
    torch.set_num_threads(1)
    cfg = {**bench.TINY_GLM51, "num_hidden_layers": 4}
    spec = spec_from_hf_config(cfg)
    weights, _ = bench.shard_weights(spec, torch.device("cpu"), torch.float32, rank, size, fp8=True)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=size)
    model = build_tp_model(spec, weights, 64, torch.device("cpu"), torch.float32, TPGroup(rank, size, dist.group.WORLD))
    moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"], moe.BLOCK_IMPL["moe"] = "triton", "triton", "triton"
    deepseek_v3.ATTENTION_IMPL["mla"] = mla_fused.FUSED_IMPL["attention"] = "triton"
    mla_fused.prepare_model(model)  # the speed path's concatenated projections (compiled.accelerate does it when served)
    seen = []
    for mod, name in ((mla_fused, "attention_block"), (moe_fused, "moe_block")):
        def spy(*a, _real=getattr(mod, name), _name=name, **k):
            seen.append((_name, k.get("residual", True)))
            return _real(*a, **k)
        setattr(mod, name, spy)
    with torch.no_grad():
        logits, _ = model.forward(torch.tensor([3, 7]), torch.tensor([0, 1]), 16)
    torch.save({"logits": logits, "seen": seen}, out)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # past the barrier: gloo's teardown racing the other rank's exit can abort a process that is done
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")
def test_two_real_ranks_fold_the_residual_into_rank_0_and_sum_to_one_rank(repo_root: Path, tmp_path: Path) -> None:
    """TPDeepseekV3Model's fused blocks on 2 ranks over gloo (real processes, Triton's interpreter on CPU): rank 0's
    blocks add the residual in their last kernel, rank 1's do not, and the all-reduced step gives the one-rank logits."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}

    def ranks(size: int) -> list[dict]:
        outs = [tmp_path / f"tp{size}-rank{r}.pt" for r in range(size)]
        procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(BENCH.parent), str(r), str(size), str(tmp_path / f"init{size}"),
                                   str(outs[r])], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(size)]
        for p in procs:
            text, _ = p.communicate(timeout=600)
            assert p.returncode == 0, text[-3000:]
        return [torch.load(o) for o in outs]

    one, two = ranks(1), ranks(2)
    assert {flag for _, flag in one[0]["seen"]} == {True}
    assert {flag for _, flag in two[0]["seen"]} == {True} and {flag for _, flag in two[1]["seen"]} == {False}
    assert {name for name, _ in two[1]["seen"]} == {"attention_block", "moe_block"}
    ref = one[0]["logits"]
    for r in two:
        err = float((r["logits"] - ref).abs().max() / ref.abs().max())
        assert err < 1e-4, err
