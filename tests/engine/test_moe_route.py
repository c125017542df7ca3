"""The fused MoE router (tilepd/engine/route_triton.py), run by Triton's CPU interpreter, against moe.route_torch
(the torch reference it replaces on CUDA) on random inputs: DeepSeek-V3's grouping (8 groups, best 4, top-8 of
256), GLM-5's (one group, top-8 of 256), a small odd shape, T = 1 and T > 1 (MTP verify rows), with and without
norm_topk_prob; then moe.route() through the switch, and ties resolved to the lowest index."""

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
    from types import SimpleNamespace
    from tilepd.engine import moe
    from tilepd.engine.route_triton import route_logits
    g = torch.Generator().manual_seed(0)
    cases = [  # (name, experts, n_group, topk_group, top_k, norm, scale, hidden, rows)
        ("deepseek-v3", 256, 8, 4, 8, True, 2.5, 64, 1), ("deepseek-v3 mtp verify", 256, 8, 4, 8, True, 2.5, 64, 4),
        ("glm-5", 256, 1, 1, 8, True, 2.5, 64, 1), ("glm-5 mtp verify", 256, 1, 1, 8, True, 2.5, 64, 3),
        ("small odd", 24, 3, 2, 3, False, 1.0, 16, 5), ("tiny", 8, 4, 2, 2, True, 2.5, 16, 2),
    ]
    checked = 0
    for name, ne, ng, tg, k, norm, scale, h, t in cases:
        spec = SimpleNamespace(n_group=ng, topk_group=tg, num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=scale)
        for trial in range(6):
            gate = torch.randn(ne, h, generator=g)
            bias = torch.randn(ne, generator=g) * (0.1 if trial % 2 else 1.0)  # bias large enough to change the choice
            x = torch.randn(t, h, generator=g)
            want_ids, want_w = moe.route_torch(x, gate, bias, spec)
            ids, w = route_logits(torch.nn.functional.linear(x.float(), gate), bias, ng, tg, k, norm, scale)
            assert ids.shape == (t, k) and ids.dtype == torch.int64 and w.dtype == torch.float32, (name, ids.shape, ids.dtype, w.dtype)
            a, ia = want_ids.sort(dim=-1)
            b, ib = ids.sort(dim=-1)
            assert torch.equal(a, b), (name, trial, want_ids.tolist(), ids.tolist())
            torch.testing.assert_close(w.gather(1, ib), want_w.gather(1, ia), rtol=1e-5, atol=1e-6)
            choice = torch.sigmoid(x.float() @ gate.T) + bias  # the kernel's order: best choice first
            ordered = choice.gather(1, ids)
            assert bool((ordered[:, :-1] >= ordered[:, 1:]).all()), (name, ordered)
            checked += 1
    # through moe.route's switch: the same as the reference
    spec = SimpleNamespace(n_group=8, topk_group=4, num_experts_per_tok=8, norm_topk_prob=True, routed_scaling_factor=2.5)
    gate, bias, x = torch.randn(256, 32, generator=g), torch.randn(256, generator=g), torch.randn(2, 32, generator=g)
    moe.ROUTE_IMPL["router"] = "triton"
    assert moe._use_route_kernel(x)
    ids, w = moe.route(x, gate, bias, spec)
    moe.ROUTE_IMPL["router"] = "torch"
    want_ids, want_w = moe.route(x, gate, bias, spec)
    assert torch.equal(ids.sort(-1)[0], want_ids.sort(-1)[0])
    torch.testing.assert_close(w.sum(-1), want_w.sum(-1))
    # ties: equal logits everywhere and no bias -> groups 0..3, then experts 0..7 (the lowest indices), equal weights
    ids, w = route_logits(torch.zeros(1, 256), torch.zeros(256), 8, 4, 8, True, 2.5)
    assert ids.tolist() == [list(range(8))], ids.tolist()
    torch.testing.assert_close(w, torch.full((1, 8), 2.5 / 8))
    # a repeated best in a group counts twice in its group score (topk(2).sum())
    logits = torch.full((1, 16), -10.0)
    logits[0, [0, 1]] = 3.0     # group 0 (experts 0..7): two at the best value
    logits[0, 8] = 3.5          # group 1: one higher, the rest low
    ids, _ = route_logits(logits, torch.zeros(16), 2, 1, 2, True, 1.0)
    assert ids.tolist() == [[0, 1]], ids.tolist()
    print(f"route kernel ok {checked}")
""")


@pytest.mark.slow
def test_route_kernel_matches_torch_reference_under_interpreter(repo_root: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _CASES], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "route kernel ok 36" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("shape,kwargs,match", [
    ((2, 256), dict(n_group=3, topk_group=1, top_k=8), "does not divide"),
    ((2, 256), dict(n_group=256, topk_group=1, top_k=1), "top 2"),
    ((2, 256), dict(n_group=8, topk_group=9, top_k=8), "topk_group=9"),
    ((2, 256), dict(n_group=8, topk_group=1, top_k=33), "num_experts_per_tok=33"),
])
def test_route_kernel_refuses_bad_shapes_by_name(shape: tuple[int, int], kwargs: dict, match: str) -> None:
    import torch

    from tilepd.engine.route_triton import route_logits

    with pytest.raises(ValueError, match=match):
        route_logits(torch.zeros(*shape), torch.zeros(shape[1]), norm_topk_prob=True, routed_scaling_factor=1.0, **kwargs)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_group,topk_group", [(8, 4), (1, 1)])
def test_route_kernel_on_cuda_matches_torch_reference(n_group: int, topk_group: int) -> None:
    """DeepSeek-V3's and GLM-5.1's routing (top-8 of 256) on bf16 activations, T = 1 and 4: the same experts and weights."""
    from types import SimpleNamespace

    import torch

    from tilepd.engine import moe

    spec = SimpleNamespace(n_group=n_group, topk_group=topk_group, num_experts_per_tok=8, norm_topk_prob=True, routed_scaling_factor=2.5)
    g = torch.Generator(device="cuda").manual_seed(0)
    before = moe.ROUTE_IMPL["router"]
    try:
        for t in (1, 4):
            for _ in range(20):
                gate = torch.randn(256, 1024, generator=g, device="cuda") * 1024 ** -0.5
                bias = torch.randn(256, generator=g, device="cuda") * 0.1
                x = torch.randn(t, 1024, generator=g, device="cuda").bfloat16()
                moe.ROUTE_IMPL["router"] = "triton"
                ids, w = moe.route(x, gate, bias, spec)
                want_ids, want_w = moe.route_torch(x, gate, bias, spec)
                a, ia = want_ids.sort(-1)
                b, ib = ids.sort(-1)
                assert torch.equal(a, b)
                torch.testing.assert_close(w.gather(1, ib), want_w.gather(1, ia), rtol=1e-5, atol=1e-6)
    finally:
        moe.ROUTE_IMPL["router"] = before
