"""Grouped GEMV over the routed experts for dense (bf16/fp32) expert weights, reading each expert in place.

Why: at decode a token uses num_experts_per_tok of n_routed_experts experts. The reference path gathers
the selected experts' weights (`w13[ids]`: a [T, k, 2*mi, h] copy, written then read again), so every MoE
layer moved ~3x the expert bytes it needs. Here row r (a (token, expert) pair) computes x[r] @ W[ids[r]].T
reading expert ids[r]'s rows where they lie: each selected expert is read once from HBM, nothing is written
but the [R, N] result. One program computes BLOCK_N outputs of one row, streaming K in BLOCK_K chunks into a
[BLOCK_N, BLOCK_K] float32 tile that is reduced once at the end; rows are the fast grid axis so programs
that share an expert tile (the same expert chosen twice) run side by side. Same structure as fp8_triton.py's
kernel, without the block scales.

Device ids only (no host sync), static shapes: runs inside the decode step's CUDA graph. Under
TRITON_INTERPRET=1 it also runs on CPU tensors, which is how tests/engine/test_moe_triton.py checks it.
"""

from __future__ import annotations


import torch

from tilepd.engine.tuning import env_int, pick_block_n

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None


# block_k: K chunk per iteration; programs: how many programs a call aims for (~8 per H200 SM), which picks
# BLOCK_N among 64/32/16 (block_n > 0 forces one). Defaults from `bench/decode_speed.py --sweep` on one H200
# (2026-11-30): DeepSeek-V3 experts top-8 (w13 + w2) 170.7 us, 4128 GB/s, with 8 warps and 8 programs per SM.
TUNE: dict[str, int] = {
    "block_k": env_int("TILEPD_MOE_BLOCK_K", 128),
    "block_n": env_int("TILEPD_MOE_BLOCK_N", 0),
    "num_warps": env_int("TILEPD_MOE_NUM_WARPS", 8),
    "programs": env_int("TILEPD_MOE_PROGRAMS", 8 * 132),
}

MAX_ROWS = 64  # (token, expert) rows a call takes; beyond that a dense batched matmul reuses each weight better


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _expert_gemv_kernel(X, W, WS, IDS, Y, N, K, s_xr, s_we, s_wn, s_yr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            X_DIV: tl.constexpr, HAS_SHARED: tl.constexpr):
        r = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        e = tl.load(IDS + r).to(tl.int64)
        w_base = W + e * s_we
        if HAS_SHARED:
            if e < 0:  # id -1: the shared expert, one more row of the same shape
                w_base = WS
        w_rows = w_base + rows.to(tl.int64)[:, None] * s_wn
        xr = r // X_DIV
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            x = tl.load(X + xr * s_xr + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += w * x[None, :]
        out = tl.sum(acc, axis=1)
        tl.store(Y + r * s_yr + rows, out.to(Y.dtype.element_ty), mask=rmask)


def _block_n(n: int, rows: int) -> int:
    return pick_block_n(n, rows, forced=TUNE["block_n"], programs=TUNE["programs"], smallest=16)


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor | None = None, x_div: int = 1) -> torch.Tensor:
    """x [R / x_div, K], weight [E, N, K] (stacked experts), ids [R] (device) -> y [R, N] with
    y[r] = x[r // x_div] @ weight[ids[r]].T, float32 accumulation, in x's dtype. With `shared` [N, K], a row whose id
    is -1 reads it instead (the shared expert as one more row of the grouped launch); x_div > 1 lets the k rows of a
    token read its one activation row (no expanded copy)."""
    if triton is None:
        raise RuntimeError("expert GEMV kernel needs Triton, which is not importable here")
    if (weight.dim() != 3 or x.dim() != 2 or ids.dim() != 1 or x_div < 1 or ids.shape[0] != x.shape[0] * x_div
            or x.shape[1] != weight.shape[2]):
        raise ValueError(f"expert GEMV: x {list(x.shape)}, weight {list(weight.shape)}, ids {list(ids.shape)}, x_div {x_div} do not fit "
                         "(x [R / x_div, K], weight [E, N, K], ids [R])")
    if weight.stride(-1) != 1:
        raise ValueError("expert GEMV: weight must be contiguous along K")
    if shared is not None and (tuple(shared.shape) != tuple(weight.shape[1:]) or shared.stride() != weight.stride()[1:]
                               or shared.dtype != weight.dtype):
        raise ValueError(f"expert GEMV: shared expert {list(shared.shape)} {shared.dtype} strides {shared.stride()} must match one "
                         f"routed expert {list(weight.shape[1:])} {weight.dtype} strides {weight.stride()[1:]}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = ids.shape[0], x.shape[1]
    n = weight.shape[1]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    tile_n = _block_n(n, rows)
    tile_k = min(TUNE["block_k"], triton.next_power_of_2(k))
    _expert_gemv_kernel[(rows, triton.cdiv(n, tile_n))](
        x, weight, shared if shared is not None else weight, ids, y, n, k, x.stride(0), weight.stride(0), weight.stride(1), y.stride(0),
        BLOCK_N=tile_n, BLOCK_K=tile_k, X_DIV=x_div, HAS_SHARED=shared is not None, num_warps=TUNE["num_warps"])
    return y
