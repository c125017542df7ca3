"""Device functions several Triton kernels share (inlined where they are called)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None


if triton is not None:

    @triton.jit
    def row_rstd(x_row, K, eps, BLOCK_K: tl.constexpr):
        """1 / sqrt(mean(x^2) + eps) of the K values at x_row, summed in float32 over BLOCK_K chunks: RMSNorm's scale,
        which a GEMV with the norm in its prologue computes itself (the row is a few KB, read from L2)."""
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            sq += xs * xs
        return 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
