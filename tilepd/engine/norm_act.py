"""RMSNorm and the SwiGLU activation: the decoders' per-row ops that the fused GEMV (gemv_triton.py) folds in.

Both the decoders (through layers.py) and the fused GEMV's unfused reference use these, so they sit below both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (statistics accumulated in float32); one fused kernel where torch has one (CUDA, torch >= 2.8)."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gu = [gate | up] along the last dim."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u
