"""The grouped expert GEMV (tilepd/engine/moe_triton.py), run by Triton's CPU interpreter, against the
gather + einsum reference it replaces on CUDA: the kernel alone (shapes off the tile sizes, an expert
chosen twice, fp32 and bf16), moe.moe() as a whole with EXPERT_IMPL switched, and the grouped form with the router
kernel (shared expert as one more row, moe_grouped) with its fp8 kernel's shared row checked alone."""

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
    from tilepd.engine import moe, moe_triton
    from tilepd.model_format.model_spec import spec_from_hf_config
    g = torch.Generator().manual_seed(0)
    moe_triton.TUNE.update(block_k=32, programs=4)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for e, n, k, ids in ((5, 100, 72, [4, 0, 4]), (3, 48, 64, [2]), (4, 16, 200, [1, 3, 0, 1, 2])):
            w = (torch.randn(e, n, k, generator=g) * k ** -0.5).to(dtype)
            x = torch.randn(len(ids), k, generator=g).to(dtype)
            ids_t = torch.tensor(ids)
            y = moe_triton.expert_gemv(x, w, ids_t)
            ref = torch.einsum("rk,rnk->rn", x.float(), w[ids_t].float())
            assert y.dtype == dtype and y.shape == (len(ids), n)
            err = float((y.float() - ref).abs().max())
            assert err < tol, (dtype, e, n, k, ids, err)
    # the whole MoE layer, both ways, on DeepSeek-style routing (grouped top-k) with a shared expert
    cfg = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 32,
           "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
           "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
           "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1}
    spec = spec_from_hf_config(cfg)
    h, mi, ne = 48, 24, 8
    w = {"l.gate": torch.randn(ne, h, generator=g), "l.gate_bias": torch.randn(ne, generator=g) * 0.01,
         "l.experts_w13": torch.randn(ne, 2 * mi, h, generator=g) * h ** -0.5, "l.experts_w2": torch.randn(ne, h, mi, generator=g) * mi ** -0.5,
         "l.shared_w13": torch.randn(2 * mi, h, generator=g) * h ** -0.5, "l.shared_w2": torch.randn(h, mi, generator=g) * mi ** -0.5}
    x = torch.randn(2, h, generator=g)
    moe.EXPERT_IMPL["dense"] = "gather"
    ref = moe.moe(x, w, "l.", spec)
    moe.EXPERT_IMPL["dense"] = "triton"
    assert moe._use_gemv(x, 6) and not moe._grouped_shared(x, w, "l.", spec)  # torch router: routed GEMV, shared apart
    out = moe.moe(x, w, "l.", spec)
    err = float((out - ref).abs().max())
    assert err < 1e-5, err
    # the grouped form (router kernel with the shared slot, shared expert as row -1, x read per token in place,
    # weighted sum as one bmm) on T = 1 and T = 3 (MTP verify rows)
    moe.ROUTE_IMPL["router"] = "triton"
    for t in (1, 3):
        x = torch.randn(t, h, generator=g)
        assert moe._grouped_shared(x, w, "l.", spec)
        out = moe.moe(x, w, "l.", spec)
        moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "gather", "torch"
        ref = moe.moe(x, w, "l.", spec)
        moe.EXPERT_IMPL["dense"], moe.ROUTE_IMPL["router"] = "triton", "triton"
        err = float((out - ref).abs().max())
        assert err < 1e-5, (t, err)
    # the fp8 kernel's shared row and in-place activation rows: launch() against the dequantised reference
    from tilepd.engine import fp8_triton
    from tilepd.model_format.block_fp8 import dequantize, quantize
    parts = [quantize(torch.randn(2 * mi, h, generator=g) * h ** -0.5, (8, 16)) for _ in range(ne)]
    ew, es = torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts])
    sh = quantize(torch.randn(2 * mi, h, generator=g) * h ** -0.5, (8, 16))
    x = torch.randn(2, h, generator=g)
    ids = torch.tensor([5, 0, -1, 3, 5, -1])
    fp8_triton.TUNE.update(block_k=16, programs=4)
    y = fp8_triton.launch(x, ew, es, ids, None, 8, 16, shared=(sh.weight, sh.scale), x_div=3)
    deq = [dequantize(sh, torch.float32) if i < 0 else dequantize(parts[i], torch.float32) for i in ids.tolist()]
    ref = torch.stack([x[r // 3] @ deq[r].T for r in range(6)])
    err = float((y - ref).abs().max())
    assert err < 1e-4, err
    # one block an expert (a TP shard's slice: scales [1, 1]) with the shared expert's scale a view of other strides
    # on those size-1 dims: read right, not refused
    parts = [quantize(torch.randn(8, 16, generator=g), (8, 16)) for _ in range(3)]
    ew, es = torch.stack([q.weight for q in parts]), torch.stack([q.scale for q in parts])
    sh = quantize(torch.randn(8, 16, generator=g), (8, 16))
    odd_scale = sh.scale.repeat(3, 5)[:1, :1]
    assert odd_scale.stride() != es.stride()[1:]
    x = torch.randn(1, 16, generator=g)
    ids = torch.tensor([2, -1])
    y = fp8_triton.launch(x, ew, es, ids, None, 8, 16, shared=(sh.weight, odd_scale), x_div=2)
    ref = torch.stack([x[0] @ dequantize(parts[2], torch.float32).T, x[0] @ dequantize(sh, torch.float32).T])
    assert float((y - ref).abs().max()) < 1e-4
    print("moe kernel ok")
""")


@pytest.mark.slow
def test_expert_gemv_matches_gather_reference_under_interpreter(repo_root: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _CASES], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "moe kernel ok" in r.stdout, r.stderr[-3000:]


def test_expert_gemv_refuses_mismatched_shapes() -> None:
    import torch

    from tilepd.engine.moe_triton import expert_gemv

    with pytest.raises(ValueError, match="do not fit"):
        expert_gemv(torch.zeros(2, 10), torch.zeros(3, 4, 12), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="shared expert"):
        expert_gemv(torch.zeros(2, 12), torch.zeros(3, 4, 12), torch.zeros(2, dtype=torch.long), shared=torch.zeros(5, 12))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_expert_gemv_on_cuda_matches_fp32_reference() -> None:
    """DeepSeek-V3's routed experts (top-8 of 256, bf16): w13 and w2 read in place vs the fp32 gather reference."""
    import torch

    from tilepd.engine.moe_triton import expert_gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    h, mi = 7168, 2048
    w13 = (torch.randn(256, 2 * mi, h, generator=g, device="cuda") * h ** -0.5).bfloat16()
    ids = torch.randperm(256, generator=g, device="cuda")[:8]
    x = torch.randn(8, h, generator=g, device="cuda").bfloat16()
    got = expert_gemv(x, w13, ids)
    want = torch.einsum("rk,rnk->rn", x.float(), w13[ids].float())
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)


def test_same_layout_ignores_the_strides_of_size_1_dims() -> None:
    import torch

    from tilepd.engine.fp8_triton import same_layout

    routed = torch.zeros(4, 1, 1)
    assert same_layout(torch.zeros(6, 2)[:1, :1], routed[0])  # strides (2, 1) against (1, 1), both [1, 1]
    assert not same_layout(torch.zeros(2, 3).t(), torch.zeros(3, 2))  # a real stride difference
    assert not same_layout(torch.zeros(1, 2), routed[0])
