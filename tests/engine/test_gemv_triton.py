"""The dense GEMV with fused norm / SiLU-mul / residual (tilepd/engine/gemv_triton.py) against the unfused ops."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tilepd.engine import gemv_triton, layers

# Run by Triton's CPU interpreter: every prologue with and without the residual, fp32 and bf16 activations, N off the
# tile and K over several chunks (block_k forced small), rows 1 and 3.
KERNEL_CASES = textwrap.dedent("""
    import torch
    from tilepd.engine import gemv_triton as gt
    g = torch.Generator().manual_seed(0)
    gt.TUNE.update({"block_k": 64, "block_n": 8})
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for rows in (1, 3):
            n, k = 37, 200
            w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
            nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
            res = torch.randn(rows, n, generator=g).to(dtype)
            for prologue in gt.PROLOGUES:
                x = torch.randn(rows, 2 * k if prologue == "silu_mul" else k, generator=g).to(dtype)
                for r in (None, res):
                    y = gt.launch(x, w, nw if prologue == "norm" else None, 1e-5, prologue, r)
                    ref = gt.reference(x, w, nw if prologue == "norm" else None, 1e-5, prologue, r)
                    assert y.dtype == dtype and y.shape == (rows, n)
                    err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                    assert err < tol, (dtype, rows, prologue, r is not None, err)
    print("kernel ok")
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not importable here (the kernel is checked on CUDA by tests/engine/test_mla_gpu_parity.py, marker gpu)")
def test_dense_gemv_kernel_under_interpreter(repo_root: Path) -> None:
    """The CUDA kernel's code, run by Triton's CPU interpreter, equals the unfused ops it replaces."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root)}
    r = subprocess.run([sys.executable, "-c", KERNEL_CASES], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "kernel ok" in r.stdout, r.stderr[-3000:]


def test_launch_refuses_mismatched_shapes_by_name() -> None:
    if not gemv_triton.available():
        pytest.skip("triton not importable here")
    w = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="prologue 'silu_mul'"):
        gemv_triton.launch(torch.zeros(1, 8), w, None, 0.0, "silu_mul", None)
    with pytest.raises(ValueError, match="expected one of"):
        gemv_triton.launch(torch.zeros(1, 8), w, None, 0.0, "gelu", None)
    with pytest.raises(ValueError, match="residual"):
        gemv_triton.launch(torch.zeros(1, 8), w, None, 0.0, "none", torch.zeros(2, 4))


def test_the_layer_helpers_keep_the_unfused_math_off_the_gpu() -> None:
    """On CPU (or with the switch off) the helpers are exactly the ops the decoders ran before."""
    g = torch.Generator().manual_seed(1)
    x, res = torch.randn(2, 16, generator=g), torch.randn(2, 8, generator=g)
    w, w2, nw = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, generator=g)
    gu = torch.randn(2, 32, generator=g)
    saved = layers.GEMV_IMPL["dense"]
    try:
        for impl in ("torch", "triton"):  # "triton" on CPU tensors: the op is never taken
            layers.GEMV_IMPL["dense"] = impl
            assert torch.equal(layers.norm_linear(x, nw, 1e-6, w), torch.nn.functional.linear(layers.rms_norm(x, nw, 1e-6), w))
            assert torch.equal(layers.linear_add(res, x, w), res + torch.nn.functional.linear(x, w))
            g_, u = gu.chunk(2, dim=-1)
            assert torch.equal(layers.silu_mul_linear_add(res, gu, w2), res + torch.nn.functional.linear(torch.nn.functional.silu(g_) * u, w2))
    finally:
        layers.GEMV_IMPL["dense"] = saved


def test_the_registered_op_off_cuda_is_the_reference() -> None:
    g = torch.Generator().manual_seed(2)
    x, w, nw = torch.randn(1, 24, generator=g), torch.randn(5, 24, generator=g), torch.randn(24, generator=g)
    res = torch.randn(1, 5, generator=g)
    y = torch.ops.tilepd.dense_gemv(x, w, nw, 1e-6, "norm", res)
    assert torch.equal(y, gemv_triton.reference(x, w, nw, 1e-6, "norm", res))
