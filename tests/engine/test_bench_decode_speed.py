"""bench/decode_speed.py's CPU path on tiny shapes, so the GPU benchmark script cannot rot; the served models' depth and
layer aliasing; step_profile's per-layer figures from profiler totals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.mark.slow
@pytest.mark.parametrize("model,extra_args", [("llama3-8b", []), ("dsv3-small", []), ("dsv3-small", ["--weights", "fp8"]), ("glm5-small", []),
                                              ("glm-5.1", ["--weights", "fp8", "--spec-tokens", "1"]), ("deepseek-v3.2", ["--layers", "5", "--no-mtp"])])
def test_decode_speed_tiny_cpu_runs_every_variant(model: str, extra_args: list[str], repo_root: Path, python_exe: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([python_exe, str(repo_root / "bench" / "decode_speed.py"), "--device", "cpu", "--tiny", "--model", model, "--json", *extra_args],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["bandwidth"]["sum_read_GBps"] > 0
    rows = report["rows"]
    variants = {row["variant"] for row in rows}
    assert {"static", "eager"} <= variants
    deep = model in ("glm-5.1", "deepseek-v3.2")  # built up to the first MoE layer, the rest aliased: no HF row either
    assert ("hf-generate" in variants) == ("fp8" not in extra_args and not deep)  # HF would run other (bf16) weights
    assert report["weights"] == ("fp8" if "fp8" in extra_args else "bf16")
    if deep:  # the tiny stand-ins: 2 dense layers + 4 MoE layers by default, --layers wins; layers 0..2 built
        assert (report["layers"], report["built_layers"]) == ((6 if model == "glm-5.1" else 5), 3)
    assert all(row["error"] is None for row in rows), [row for row in rows if row["error"]]
    for row in rows:
        assert row["ms_per_token"] > 0 and 0 < row["pct_of_floor"]
        assert str(row["context"]) in report["floor"]
    if model == "glm5-small":  # the DSA floor: 2 layers x (16 selected 80-wide latent rows + all 32-wide indexer keys), fp32
        assert report["floor"]["32"]["kv_GB"] * 1e9 == pytest.approx(2 * (16 * 80 + 32 * 32) * 4)
        assert report["floor"]["64"]["kv_GB"] * 1e9 == pytest.approx(2 * (16 * 80 + 64 * 32) * 4)
    if model == "glm-5.1":  # the DSA floor at depth: 6 layers, each its own indexer
        assert report["floor"]["32"]["kv_GB"] * 1e9 == pytest.approx(6 * (16 * 80 + 32 * 32) * 4)
    spec_rows = [row for row in rows if row["variant"].startswith("mtp-spec")]
    if model in ("dsv3-small", "glm5-small", "glm-5.1"):
        assert spec_rows and "acceptance_rate" in spec_rows[0]["extra"]
        for row in rows:  # the forced rows say whether a first-token split from the plain decode is a near tie
            if row["variant"].startswith("mtp-forced"):
                e = row["extra"]
                assert "first_token_check_error" not in e, e
                assert e["first_token_margin"] >= 0 and e["verify_row0_max_abs_diff"] >= 0
                assert isinstance(e["verify_row0_argmax_agrees"], bool)
    else:  # llama has no MTP layer; --no-mtp skips the rows
        assert not spec_rows


def test_served_models_run_at_their_real_depth_with_the_first_moe_layer_aliased() -> None:
    """glm-5.1 is 78 layers and deepseek-v3/v3.2 61 by default (3 dense first), the -small shapes 2; what is built
    is layers 0..3, the deeper layers alias layer 3's tensors and still count in the floor."""
    import torch

    from kit import build_weights, model_spec, step_read_bytes

    for model, depth, dsa in (("glm-5.1", 78, True), ("deepseek-v3", 61, False), ("deepseek-v3.2", 61, True), ("dsv3-small", 2, False)):
        _, spec, built = model_spec(model, tiny=False, layers=None)
        assert (spec.num_layers, spec.is_dsa) == (depth, dsa), model
        assert built.num_layers == min(depth, 4) and built.first_k_dense_replace == (1 if depth == 2 else 3), model
    assert model_spec("glm-5.1", tiny=False, layers=10)[1].num_layers == 10
    with pytest.raises(SystemExit, match="--layers is for the DeepSeek-family"):
        model_spec("llama3-8b", tiny=False, layers=4)
    _, spec, built = model_spec("glm-5.1", tiny=True, layers=None)
    w = build_weights(spec, built, torch.device("cpu"), torch.float32, "bf16")
    assert w["layers.5.experts_w13"] is w["layers.2.experts_w13"] and w["layers.5.gate"] is w["layers.2.gate"]
    assert "layers.1.w13" in w and "layers.2.w13" not in w  # layers 0, 1 dense, 2.. MoE
    per_moe = sum(t.numel() * 4 * (spec.num_experts_per_tok / spec.n_routed_experts if n.endswith(("experts_w13", "experts_w2")) else 1)
                  for n, t in w.items() if n.startswith("layers.2."))
    shallow = step_read_bytes(spec, {n: t for n, t in w.items() if not n.startswith(("layers.3.", "layers.4.", "layers.5."))}, 32)[0]
    assert step_read_bytes(spec, w, 32)[0] == pytest.approx(shallow + 3 * per_moe)


def test_step_summary_counts_launches_gaps_and_non_gemv_time_per_layer() -> None:
    from step_profile import is_gemv_kernel, summarize_kernels

    per = {"_fp8_gemv_kernel": (2000.0, 40), "_expert_gemv_kernel": (800.0, 20), "gemv2T_kernel_val<float>": (100.0, 10),
           "_route_kernel": (50.0, 10), "_mla_split_kernel": (300.0, 20), "void at::native::elementwise_kernel<...>": (150.0, 30)}
    assert is_gemv_kernel("sm90_xmma_gemm_bf16bf16") and not is_gemv_kernel("_route_kernel")
    p = summarize_kernels(per, steps=10, layers=2, step_us=400.0, top=3)
    assert p["kernels_us_per_step"] == pytest.approx(340.0) and p["gaps_us_per_step"] == pytest.approx(60.0)
    assert (p["launches_per_step"], p["launches_per_layer"]) == (13.0, 6.5)
    assert p["gemv_us_per_step"] == pytest.approx(290.0) and p["gemv_launches_per_step"] == 7.0
    assert p["non_gemv_us_per_layer"] == pytest.approx(25.0) and p["gaps_us_per_layer"] == pytest.approx(30.0)
    assert [k["name"] for k in p["kernels"]] == ["_fp8_gemv_kernel", "_expert_gemv_kernel", "_mla_split_kernel"]
    with pytest.raises(ValueError, match="steps > 0"):
        summarize_kernels(per, steps=0, layers=2, step_us=1.0)


@pytest.mark.slow
def test_verify_rows_finds_row_zero_unchanged_by_more_rows_on_the_cpu_reference(repo_root: Path, python_exe: str, tmp_path: Path) -> None:
    """bench/verify_rows.py on the tiny GLM-5.1 stand-in (fp8 weights, DSA, MoE; CPU float32 reference ops): row 0 of
    a 2- and 4-row forward is the one-row forward's up to float32 rounding at every depth, and the repeat is exact."""
    out = tmp_path / "rows.json"
    r = subprocess.run([python_exe, str(repo_root / "bench" / "verify_rows.py"), "--device", "cpu", "--tiny", "--model", "glm-5.1",
                        "--weights", "fp8", "--rows", "2", "4", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [d["depth"] for d in report["depths"]] == [1, 2, 4, 6] and report["path"] == "reference"
    for d in report["depths"]:
        assert d["repeat"]["hidden_rel"] == 0.0 and d["margin"] > 0, d
        for rows in ("2", "4"):
            v = d["rows"][rows]
            assert v["hidden_rel"] < 1e-5 and v["logits_rel"] < 1e-5 and v["argmax_agrees"] and v["repeat_hidden_rel"] == 0.0, (d["depth"], rows, v)
