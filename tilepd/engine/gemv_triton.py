"""Triton GEMV for dense (bf16/fp16/fp32) weights at decode batch sizes, with the layer's small ops fused in.

At batch 1 a Llama layer's element-wise work (the two RMSNorms, SiLU * up, the two residual adds) runs as
separate small kernels around the four GEMVs (~14 kernels a layer, ~0.9 ms of gaps between kernels a step for
Llama-3-8B on one H200), and under torch.compile Inductor lowers the GEMVs into reductions of its own whose picked
configs moved the step by ~8% between compilations (docs/PERFORMANCE.md). Here the small ops ride inside the GEMV
that reads the weights anyway:

- prologue "norm": y = W @ rms_norm(x) * g: each program first sums x's squares (x is a few KB, read from L2);
- prologue "silu_mul": x holds [gate | up] (2K wide) and y = W @ (silu(gate) * up);
- epilogue residual: y = res + W @ x'.

Intermediates are rounded to the activation dtype where the unfused path rounds them (the normed row, silu,
the product, the GEMV output before the add), so the fused path equals the unfused one up to accumulation order.
One program computes BLOCK_N outputs of one activation row over K in BLOCK_K chunks, reducing each chunk; the
tile depends on the weight's shape (`tile`).

Registered as `tilepd::dense_gemv`, opaque to torch.compile and captured in the CUDA graph; its non-CUDA
implementation is the unfused torch reference. Under TRITON_INTERPRET=1 `launch` runs on CPU tensors, which is how
the CPU test checks the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilepd.engine import norm_act, pdl

try:
    import triton
    import triton.language as tl
    from tilepd.engine.pdl import prefetch_l2, trigger, wait
    from tilepd.engine.triton_rows import row_rstd
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

PROLOGUES = ("none", "norm", "silu_mul")

# Forced tile settings (0: the shape's rule below); bench/dense_gemv_sweep.py sets them to sweep.
TUNE: dict[str, int] = {"block_n": 0, "block_k": 0, "num_warps": 0}


def tile(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight, from bench/dense_gemv_sweep.py on one H200 (2026-12-01,
    Llama-3-8B's four GEMVs with their fusions: 116 us a layer with these against 133 with one tile for all and 121 for
    cuBLAS without the fusions). Wide outputs take 16 rows a program (thousands of programs anyway); long rows take
    wider K chunks and more warps (few programs, long loops); small weights take 2 rows a program to launch enough."""
    if n >= 16384:
        cfg = (16, 512, 4)
    elif k >= 8192:
        cfg = (8, 1024, 8)
    elif n * k <= 4096 * 4096:
        cfg = (2, 2048, 8)
    else:
        cfg = (4, 512, 4)
    return TUNE["block_n"] or cfg[0], TUNE["block_k"] or cfg[1], TUNE["num_warps"] or cfg[2]


# Largest activation row count the kernel takes; more rows (prefill-sized calls) go to the unfused path.
MAX_ROWS = 8


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _dense_gemv_kernel(X, W, NW, RES, Y, N, K, s_xr, s_wn, s_rr, s_yr, eps,
                           PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
        r = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        w_rows = W + rows.to(tl.int64)[:, None] * s_wn
        if PREFETCH:  # before the wait (pdl.py): the tile's first K chunk into L2, one address a 128-byte line
            lines = tl.arange(0, BLOCK_K // 64) * 64  # 2-byte weights (PREFETCH is only set for them)
            prefetch_l2(w_rows + lines[None, :], rmask[:, None] & (lines < K)[None, :])
        wait(PDL)
        x_row = X + r * s_xr
        act = Y.dtype.element_ty
        if PROLOGUE == 1:  # rms_norm: the row's mean square first
            rstd = row_rstd(x_row, K, eps, BLOCK_K)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            if PROLOGUE == 1:
                xs = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
                g = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
                x = (xs * rstd).to(act).to(tl.float32) * g
                x = x.to(act).to(tl.float32)
            elif PROLOGUE == 2:
                gate = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
                up = tl.load(x_row + K + cols, mask=cmask, other=0.0).to(tl.float32)
                s = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
                x = (s * up).to(act).to(tl.float32)
            else:
                x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        out = acc
        if HAS_RES:
            out = out.to(act).to(tl.float32) + tl.load(RES + r * s_rr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(Y + r * s_yr + rows, out.to(act), mask=rmask)
        trigger(PDL)  # pdl.py: the late form triggers here


def launch(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, prologue: str,
           residual: torch.Tensor | None, chain: bool = False, site: str = "gemv") -> torch.Tensor:
    """x [R, K] (silu_mul: [R, 2K]); weight [N, K]; residual [R, N] -> [R, N] in x's dtype. chain: launched among the
    fused decode step's Triton kernels, so with programmatic dependent launch where pdl.py allows it (the Llama path's
    neighbours are Inductor's kernels, which never trigger it: it stays off there); site: its PDL site (pdl.SITES)."""
    if triton is None:
        raise RuntimeError("dense GEMV kernel needs Triton, which is not importable here")
    if prologue not in PROLOGUES:
        raise ValueError(f"dense GEMV prologue {prologue!r}: expected one of {PROLOGUES}")
    rows = x.shape[0]
    n, k = weight.shape
    if x.shape[1] != (2 * k if prologue == "silu_mul" else k):
        raise ValueError(f"dense GEMV: x is {tuple(x.shape)} for a [{n}, {k}] weight with prologue {prologue!r}")
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("dense GEMV kernel: weight and x must be contiguous along K")
    if residual is not None and (residual.shape != (rows, n) or residual.stride(-1) != 1):
        raise ValueError(f"dense GEMV: residual is {tuple(residual.shape)}, expected ({rows}, {n}) contiguous")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    tile_n, tile_k, warps = tile(n, k)
    tile_k = min(tile_k, triton.next_power_of_2(k))
    grid = (rows, triton.cdiv(n, tile_n))
    _dense_gemv_kernel[grid](
        x, weight, norm_weight if norm_weight is not None else x, residual if residual is not None else x, y, n, k,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), eps,
        PROLOGUE=PROLOGUES.index(prologue), HAS_RES=residual is not None, BLOCK_N=tile_n, BLOCK_K=tile_k,
        PREFETCH=chain and pdl.prefetch_flag(x, site=site) and weight.element_size() == 2 and tile_k >= 64,
        num_warps=warps, **(pdl.launch_args(x, site=site) if chain else pdl.OFF),
    )
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, prologue: str,
              residual: torch.Tensor | None) -> torch.Tensor:
    """The unfused ops the kernel replaces, in the decoders' own order and dtypes."""
    if prologue == "norm":
        x = norm_act.rms_norm(x, norm_weight, eps)
    elif prologue == "silu_mul":
        x = norm_act.silu_mul(x)
    y = F.linear(x, weight)
    return y if residual is None else residual + y


@torch.library.custom_op("tilepd::dense_gemv", mutates_args=())
def dense_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, prologue: str,
               residual: torch.Tensor | None) -> torch.Tensor:
    """[R, N] = (residual +) weight @ prologue(x) per row; float32 accumulation."""
    if x.is_cuda and triton is not None:
        return launch(x.contiguous(), weight, norm_weight, eps, prologue, residual)
    return reference(x, weight, norm_weight, eps, prologue, residual)


@dense_gemv.register_fake
def _(x, weight, norm_weight, eps, prologue, residual):  # noqa: ANN001, ANN202 - the op's shapes for torch.compile
    return x.new_empty(x.shape[0], weight.shape[0])
