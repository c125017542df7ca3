"""The fused MoE block (tilepd/engine/moe_fused.py and its kernels, moe_fused_triton.py), run by Triton's CPU interpreter,
against the torch ops it replaces: the gate kernel (norm, float32 router GEMV, noaux_tc routing with the shared slot,
routed apart and in its last program, the two equal) with DeepSeek-V3's grouping and GLM-5's, T = 1 and 4, the row in one K chunk and in several, ties; the gate-up kernel
(grouped GEMV, silu-mul) and the down kernel (grouped GEMV, weighted sum, residual) with dense and fp8 weights (scales
per row block and per row); the whole block against rms_norm + moe_grouped + the add; mlp_block through the switches. HF's greedy tokens through the whole speed path (this block included) are
test_dsa_kernels.py's engine test.

The interpreter rounds float32 -> bf16 toward zero (the GPU rounds to nearest even), so bf16 cases compare within a few
bf16 ulps; float32 cases compare to float32 accumulation order. bench/moe_fused_gpu.py checks the rounding on the GPU."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch

from tests.engine.interpret import interpret

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here")

_KERNELS = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from types import SimpleNamespace
    from tilepd.engine import grid_sync, layers, moe, moe_fused, moe_fused_triton as K
    from tilepd.model_format.block_fp8 import BlockFp8, dequantize, quantize
    g = torch.Generator().manual_seed(0)
    K.TUNE.update(gate_block_e=32, gate_block_k=16, up_block_n=8, up_block_n_fp8=8, up_block_k=16, up_block_k_fp8=16, down_block_n=8,
                  down_block_k=16, down_block_k_fp8=16, up_block_n_fp8_few=4, up_block_k_fp8_few=32, up_few=0)
    cpu = torch.device("cpu")
    checked = 0
    # 1. gate: (name, experts, n_group, topk_group, top_k, hidden, rows); hidden 40 is off the 16-wide K chunks
    for dtype, tol, chunk in ((torch.float32, 1e-5, 16), (torch.bfloat16, 3e-2, 16), (torch.float32, 1e-5, 64), (torch.bfloat16, 3e-2, 64)):
        K.TUNE["gate_block_k"] = chunk  # 16: three K chunks (40 is off them); 64: the row in one chunk (the served shapes' path)
        for name, ne, ng, tg, k, h, t in (("deepseek-v3", 256, 8, 4, 8, 40, 1), ("deepseek-v3 mtp", 256, 8, 4, 8, 40, 4),
                                          ("glm-5", 256, 1, 1, 8, 40, 1), ("glm-5 mtp", 256, 1, 1, 8, 40, 4), ("odd", 24, 3, 2, 3, 24, 2)):
            spec = SimpleNamespace(n_group=ng, topk_group=tg, num_experts_per_tok=k, norm_topk_prob=name != "odd", routed_scaling_factor=2.5)
            x = (torch.randn(t, h, generator=g) * 3).to(dtype)
            nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
            gate, bias = torch.randn(ne, h, generator=g) * h ** -0.5, torch.randn(ne, generator=g) * 0.3
            hn, ids, w, logits = K.gate_route(x, nw, 1e-6, gate, bias, ng, tg, k, spec.norm_topk_prob, 2.5)
            want_h = layers.rms_norm(x, nw, 1e-6)
            assert hn.dtype == dtype and ids.shape == (t, k + 1) and w.dtype == dtype and logits.dtype == torch.float32
            assert float((hn.float() - want_h.float()).abs().max()) <= tol * float(want_h.float().abs().max()), (name, dtype, chunk)
            torch.testing.assert_close(logits, F.linear(hn.float(), gate), rtol=1e-5, atol=1e-5)
            # the routing of the kernel's own logits, by the torch reference (an identity gate passes logits through exactly)
            want_ids, want_w = moe.route_torch(logits, torch.eye(ne), bias, spec)
            a, ia = want_ids.sort(-1)
            b, ib = ids[:, :k].sort(-1)
            assert torch.equal(a, b), (name, dtype, ids.tolist(), want_ids.tolist())
            torch.testing.assert_close(w[:, :k].float().gather(1, ib), want_w.to(dtype).float().gather(1, ia), rtol=tol, atol=tol)
            assert ids[:, k].tolist() == [-1] * t and w[:, k].tolist() == [1.0] * t  # the shared slot
            K.TUNE["route_apart"] = 1 - K.TUNE["route_apart"]  # the other form: routed by the gate's last program / apart
            other = K.gate_route(x, nw, 1e-6, gate, bias, ng, tg, k, spec.norm_topk_prob, 2.5)
            K.TUNE["route_apart"] = 1 - K.TUNE["route_apart"]
            assert all(torch.equal(u, v) for u, v in zip((hn, ids, w, logits), other)), (name, dtype, chunk, "the two routing forms")
            assert int(grid_sync.counter(cpu, "fused MoE gate ticket")) == 0, "the ticket counter is back to 0 for the next launch"
            checked += 1
    # ties: equal logits (a zero gate) and no bias -> groups 0..3, then experts 0..7, equal weights
    _, ids, w, _ = K.gate_route(torch.randn(2, 40, generator=g), torch.ones(40), 1e-6, torch.zeros(256, 40), torch.zeros(256), 8, 4, 8, True, 2.5)
    assert ids.tolist() == [list(range(8)) + [-1]] * 2, ids.tolist()
    torch.testing.assert_close(w, torch.tensor([[2.5 / 8] * 8 + [1.0]] * 2))
    # 2. gate-up and down: dense fp32/bf16 and fp8 experts (block (8, 16): the tile's rows in one row block; (1, 16): per-row
    # scales), against the dequantised weights through torch: GEMV, silu_mul, GEMV, the weighted sum as a bmm, the add
    def gate_up_ref(hn, wdq, sdq, ids):
        mats = [sdq if i < 0 else wdq[i] for i in ids.reshape(-1).tolist()]
        s = ids.shape[1]
        gu = torch.stack([hn[r // s].float() @ mats[r].float().T for r in range(ids.numel())]).to(hn.dtype)
        return layers.silu_mul(gu)
    def down_ref(a, wdq, sdq, ids, w, res):
        mats = [sdq if i < 0 else wdq[i] for i in ids.reshape(-1).tolist()]
        y = torch.stack([a[r].float() @ mats[r].float().T for r in range(a.shape[0])]).to(a.dtype)
        return res + torch.bmm(w.view(ids.shape[0], 1, -1), y.view(ids.shape[0], ids.shape[1], -1)).view(ids.shape[0], -1)
    def stacked(v, fmt, dtype, block):
        if fmt == "dense":
            return v.to(dtype), v.to(dtype)
        if v.dim() == 2:
            q = quantize(v, block)
        else:
            parts = [quantize(v[e], block) for e in range(v.shape[0])]
            q = BlockFp8(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), block)
        return q, dequantize(q, dtype)
    ne, hid, mi = 6, 40, 24
    for fmt, dtype, tol in (("dense", torch.float32, 1e-5), ("dense", torch.bfloat16, 3e-2), ("fp8", torch.float32, 1e-5),
                            ("fp8-rows", torch.bfloat16, 3e-2)):
        block = (8, 16) if fmt == "fp8" else (1, 16)
        w13, w13dq = stacked(torch.randn(ne, 2 * mi, hid, generator=g) * hid ** -0.5, fmt, dtype, block)
        s13, s13dq = stacked(torch.randn(2 * mi, hid, generator=g) * hid ** -0.5, fmt, dtype, block)
        w2, wdq = stacked(torch.randn(ne, hid, mi, generator=g) * mi ** -0.5, fmt, dtype, block)
        s2, sdq = stacked(torch.randn(hid, mi, generator=g) * mi ** -0.5, fmt, dtype, block)
        for t in (1, 3):
            ids = torch.tensor([[4, 0, 4, -1], [2, 5, 1, -1], [0, 3, 5, -1]][:t])  # expert 4 twice in a row: read twice
            w = torch.rand(t, 4, generator=g).to(dtype)
            hn = torch.randn(t, hid, generator=g).to(dtype)
            want_a = gate_up_ref(hn, w13dq, s13dq, ids)
            for few in (0, 1 << 30):  # fp8: the launch's own tile, then the narrow, long one of launches with few programs
                K.TUNE["up_few"] = few
                a = K.gate_up_act(hn, w13, s13, ids)
                assert a.dtype == dtype and a.shape == (t * 4, mi)
                err = float((a.float() - want_a.float()).abs().max() / want_a.float().abs().max())
                assert err < tol, ("gate-up", fmt, dtype, t, few, err)
            K.TUNE["up_few"] = 0
            res = torch.randn(t, hid, generator=g).to(dtype)
            a = torch.randn(t * 4, mi, generator=g).to(dtype)
            got = K.down_combine(a, w2, s2, ids, w, res)
            want = down_ref(a, wdq, sdq, ids, w, res)
            assert got.dtype == dtype and got.shape == (t, hid)
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            assert err < tol, ("down", fmt, dtype, t, err)
            checked += 2
    # 3. the whole block against rms_norm + moe_grouped + the add, and mlp_block through the switches
    def layer_weights(fp8, ne, ng, dtype):
        hid, mi = 48, 24
        w = {"l.mlp_norm": (1 + 0.1 * torch.randn(hid, generator=g)).to(dtype), "l.gate": torch.randn(ne, hid, generator=g) * hid ** -0.5,
             "l.gate_bias": torch.randn(ne, generator=g) * 0.1}
        for name, shape in (("experts_w13", (ne, 2 * mi, hid)), ("experts_w2", (ne, hid, mi)), ("shared_w13", (2 * mi, hid)), ("shared_w2", (hid, mi))):
            v = torch.randn(*shape, generator=g) * shape[-1] ** -0.5
            if not fp8:
                w["l." + name] = v.to(dtype)
            elif v.dim() == 2:
                w["l." + name] = quantize(v, (8, 16))
            else:
                parts = [quantize(v[e], (8, 16)) for e in range(v.shape[0])]
                w["l." + name] = BlockFp8(torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts]), (8, 16))
        return w
    moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "triton", "triton"
    for fp8 in (False, True):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            for ne, ng, tg, k in ((16, 4, 2, 3), (16, 1, 1, 4)):  # DeepSeek-V3-style groups; GLM-5's single group
                spec = SimpleNamespace(n_group=ng, topk_group=tg, num_experts_per_tok=k, norm_topk_prob=True, routed_scaling_factor=2.5,
                                       rms_norm_eps=1e-6)
                w = layer_weights(fp8, ne, ng, dtype)
                for t in (1, 4):
                    x = (torch.randn(t, 48, generator=g) * 2).to(dtype)
                    assert moe_fused.applies(x, w, "l.", spec), (fp8, dtype, t)
                    got = moe_fused.moe_block(x, w, "l.", spec)
                    want = x + moe.moe_grouped(layers.rms_norm(x, w["l.mlp_norm"], 1e-6), w, "l.", spec)
                    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                    assert got.dtype == dtype and err < tol, (fp8, dtype, ng, t, err)
                    alone = moe_fused.moe_block(x, w, "l.", spec, residual=False)  # tensor parallelism's form: no add
                    want_alone = want - x if dtype == torch.float32 else moe.moe_grouped(layers.rms_norm(x, w["l.mlp_norm"], 1e-6), w, "l.", spec)
                    err = float((alone.float() - want_alone.float()).abs().max() / want_alone.float().abs().max())
                    assert alone.dtype == dtype and err < tol, ("no residual", fp8, dtype, ng, t, err)
                    if dtype == torch.float32:  # no rounding in between: the add is the only difference
                        assert torch.equal(alone + x, got), (fp8, ng, t)
                    moe.BLOCK_IMPL["moe"] = "triton"
                    assert moe.use_fused_block(x, w, "l.", spec)
                    assert torch.equal(moe.mlp_block(x, w, "l.", spec, True), got)
                    moe.BLOCK_IMPL["moe"] = "torch"
                    checked += 1
    print(f"moe fused ok {checked}")
""")


@pytest.mark.slow
def test_fused_moe_kernels_match_the_torch_ops_under_interpreter(repo_root: Path) -> None:
    r = interpret(["-c", _KERNELS], repo_root, timeout=900)
    assert r.returncode == 0 and "moe fused ok 52" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_fused_moe_refuses_bad_shapes_by_name() -> None:
    from tilepd.engine.moe_fused_triton import down_combine, gate_route, gate_up_act
    from tilepd.model_format.block_fp8 import quantize

    x, nw, gate, bias = torch.zeros(1, 16), torch.ones(16), torch.zeros(8, 16), torch.zeros(8)
    with pytest.raises(ValueError, match="do not fit"):
        gate_route(x, nw, 1e-6, torch.zeros(8, 12), bias, 1, 1, 2, True, 1.0)
    with pytest.raises(ValueError, match="n_group=3 does not divide"):
        gate_route(x, nw, 1e-6, gate, bias, 3, 1, 2, True, 1.0)
    ids, w = torch.tensor([[0, -1]]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="must match one routed expert"):
        down_combine(torch.zeros(2, 16), torch.zeros(3, 16, 8), torch.zeros(16, 4), ids, w, torch.zeros(1, 16))
    with pytest.raises(ValueError, match="do not fit"):
        down_combine(torch.zeros(2, 12), torch.zeros(3, 16, 8), torch.zeros(16, 8), ids, w, torch.zeros(1, 16))
    with pytest.raises(ValueError, match="must match one routed expert"):
        gate_up_act(torch.zeros(1, 16), torch.zeros(3, 8, 16), torch.zeros(8, 12), ids)
    with pytest.raises(ValueError, match="do not fit"):
        gate_up_act(torch.zeros(1, 12), torch.zeros(3, 8, 16), torch.zeros(8, 16), ids)
    with pytest.raises(ValueError, match="both be fp8 or both dense"):
        gate_up_act(torch.zeros(1, 16), torch.zeros(3, 8, 16), quantize(torch.zeros(8, 16)), ids)


def test_mlp_block_off_the_switch_is_the_unfused_ops() -> None:
    """Switch off (or a CPU tensor without the interpreter): the norm, moe() and the add, as deepseek_v3 ran them."""
    from types import SimpleNamespace

    from tilepd.engine import layers, moe

    g = torch.Generator().manual_seed(0)
    spec = SimpleNamespace(n_group=2, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
    w = {"l.mlp_norm": torch.rand(16, generator=g) + 0.5, "l.gate": torch.randn(8, 16, generator=g), "l.gate_bias": torch.zeros(8),
         "l.experts_w13": torch.randn(8, 12, 16, generator=g), "l.experts_w2": torch.randn(8, 16, 6, generator=g),
         "l.shared_w13": torch.randn(12, 16, generator=g), "l.shared_w2": torch.randn(16, 6, generator=g),
         "l.w13": torch.randn(12, 16, generator=g), "l.w2": torch.randn(16, 6, generator=g)}
    x = torch.randn(2, 16, generator=g)
    h = layers.rms_norm(x, w["l.mlp_norm"], 1e-6)
    assert torch.equal(moe.mlp_block(x, w, "l.", spec, True), x + moe.moe(h, w, "l.", spec))
    assert torch.equal(moe.mlp_block(x, w, "l.", spec, False), x + layers.swiglu(h, w["l.w13"], w["l.w2"]))


@pytest.mark.slow
def test_moe_fused_gpu_bench_runs_on_tiny_shapes_under_interpreter(repo_root: Path, tmp_path: Path) -> None:
    """bench/moe_fused_gpu.py's code on the tiny stand-in shapes (CPU, float32), so the GPU bench cannot rot: every
    model, format and T agrees with today's ops, with no expert set flipped."""
    out = tmp_path / "moe_fused.json"
    r = interpret([str(repo_root / "bench" / "moe_fused_gpu.py"), "--device", "cpu", "--tiny", "--out", str(out)], repo_root, timeout=900)
    assert r.returncode == 0 and "moe fused gpu ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == [f"{m} {f} T={t}" for m in ("glm-5.1", "deepseek-v3") for f in ("bf16", "fp8") for t in (1, 2, 4)]
    assert all(r["id_mismatches"] == 0 and r["max_rel"] < 1e-5 for r in rows), rows
