"""Triton GEMV for block-scaled fp8 weights at decode batch sizes (a few activation rows).

One program computes BLOCK_N outputs of one activation row: it streams the fp8 rows of its tile once,
converts to float32, multiplies by the activation chunk and the block scales, and accumulates a
[BLOCK_N, BLOCK_K] float32 tile that is reduced once at the end (no cross-thread reduction per chunk).
When the tile's rows lie in one row block (128x128 scales, BLOCK_N dividing 128) the scales are one
vector per K chunk, folded into the activations; per-row scales (block_n 1) are gathered per element.
Activation rows are the fast grid axis, so the programs that share a weight tile run side by side and
the second read comes from L2. With `ids`, row r reads expert ids[r]'s weight and scales in place (MoE:
no gathered copy of the selected experts).

Registered as the custom op `tilepd::fp8_gemv`, so torch.compile sees one opaque call and a CUDA graph
captures the launch (the kernel is compiled at the first, uncaptured warm-up call). The op's non-CUDA
implementation is the dequantise-then-matmul reference. Under TRITON_INTERPRET=1 the kernel itself also
runs on CPU tensors (`launch`), which is how the CPU test checks it.
"""

from __future__ import annotations

import torch

from tilepd.engine import pdl
from tilepd.engine.tuning import env_int, pick_block_n

try:
    import triton
    import triton.language as tl
    from tilepd.engine.pdl import prefetch_l2, trigger, wait
    from tilepd.engine.triton_rows import row_rstd
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

_TARGET_PROGRAMS = 2 * 132  # ~2 waves on an H200 (132 SMs)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _chunk_scales(s_base, rows, rmask, row0, s_sn, cols, cmask, BN: tl.constexpr, BK: tl.constexpr, ROW_UNIFORM: tl.constexpr):
        """One K chunk's block scales: [BLOCK_K] where the tile's rows share one row block (ROW_UNIFORM; row0 its
        first row), else [BLOCK_N, BLOCK_K] gathered per element."""
        if ROW_UNIFORM:  # (one return: Triton types the function by its returns, both branches alike)
            s = tl.load(s_base + (row0 // BN) * s_sn + cols // BK, mask=cmask, other=0.0)
        else:
            s = tl.load(s_base + (rows // BN)[:, None] * s_sn + (cols // BK)[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        return s

    @triton.jit
    def _chunk_prod(w, s, x_row, NW, rstd, cols, cmask, act, ROW_UNIFORM: tl.constexpr, BITS_CVT: tl.constexpr, NORM: tl.constexpr):
        """One K chunk's products [BLOCK_N, BLOCK_K] in float32 from its weight tile w as loaded (e4m3, or its bytes)
        and its scales s (_chunk_scales)."""
        if BITS_CVT:
            # W holds the e4m3 bytes as uint8: sign to bit 15 and exponent+mantissa to bits 13..7 is the same
            # number as fp16 times 2^-8 (normals and subnormals alike), two integer ops instead of cvt
            b = w.to(tl.uint16)
            wf = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            wf = w.to(tl.float32)
        x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
        if NORM:  # rounded where the unfused path rounds (the normed row, then times the norm weight)
            g = tl.load(NW + cols, mask=cmask, other=0.0).to(tl.float32)
            x = ((x * rstd).to(act).to(tl.float32) * g).to(act).to(tl.float32)
        if BITS_CVT:
            x = x * 256.0
        return _fold_scales(wf, s, x, ROW_UNIFORM)

    @triton.jit
    def _fold_scales(w, s, x, ROW_UNIFORM: tl.constexpr):
        """A chunk's products [BLOCK_N, BLOCK_K]: w (float32) times its block scales s (_chunk_scales) times the
        activations x [BLOCK_K]. Where the tile's rows share one row block the scales fold into x: one multiply a
        column, not one an element."""
        if ROW_UNIFORM:
            prod = w * (x * s)[None, :]
        else:
            prod = w * s * x[None, :]
        return prod

    @triton.jit
    def _fp8_gemv_kernel(X, W, S, WS, SS, IDS, BIAS, Y, N, K, s_xr, s_we, s_wn, s_se, s_sn, s_yr,
                         BN: tl.constexpr, BK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_UNIFORM: tl.constexpr,
                         BITS_CVT: tl.constexpr, REDUCE_EACH: tl.constexpr, HAS_SHARED: tl.constexpr, X_DIV: tl.constexpr,
                         NW, RES, eps, s_rr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                         PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, PRELOAD_K: tl.constexpr = 0):
        r = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        act = Y.dtype.element_ty
        if PREFETCH:  # before the wait (pdl.py): the tile's first K chunk of weight bytes into L2, one address a line
            lines = tl.arange(0, BLOCK_K // 128) * 128
            prefetch_l2(W + rows.to(tl.int64)[:, None] * s_wn + lines[None, :], rmask[:, None] & (lines < K)[None, :])
        if PRELOAD_K:  # before the wait (pdl.py; no ids: the rows are known): the first PRELOAD_K columns and their scales
            cols0 = tl.arange(0, PRELOAD_K)  # into registers (a multiple of BLOCK_K; wider than it only with REDUCE_EACH)
            cmask0 = cols0 < K
            w0 = tl.load(W + rows.to(tl.int64)[:, None] * s_wn + cols0[None, :], mask=rmask[:, None] & cmask0[None, :], other=0.0)
            s0 = _chunk_scales(S, rows, rmask, pid_n * BLOCK_N, s_sn, cols0, cmask0, BN, BK, ROW_UNIFORM)
        wait(PDL)
        x_row = X + (r // X_DIV) * s_xr
        w_base = W
        s_base = S
        if HAS_IDS:
            e = tl.load(IDS + r).to(tl.int64)
            w_base = W + e * s_we
            s_base = S + e * s_se
            if HAS_SHARED:
                if e < 0:  # id -1: the shared expert (same shape, block scales and strides as one routed expert)
                    w_base = WS
                    s_base = SS
        w_rows = w_base + rows.to(tl.int64)[:, None] * s_wn
        if REDUCE_EACH:  # wide K chunks: a [BLOCK_N] accumulator (a [BLOCK_N, BLOCK_K] one would spill)
            acc_rows = tl.zeros([BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if NORM:  # rms_norm(x) * NW in the prologue: the row's mean square first (x is a few KB, from L2)
            rstd = row_rstd(x_row, K, eps, BLOCK_K)
        else:
            rstd = 1.0
        k_first = 0
        if PRELOAD_K:  # the preloaded columns first (one BLOCK_K chunk: the same order of sums as the loop's)
            prod0 = _chunk_prod(w0, s0, x_row, NW, rstd, cols0, cmask0, act, ROW_UNIFORM, BITS_CVT, NORM)
            if REDUCE_EACH:
                acc_rows += tl.sum(prod0, axis=1)
            else:
                acc += prod0
            k_first = PRELOAD_K
        for k0 in range(k_first, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < K
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            s = _chunk_scales(s_base, rows, rmask, pid_n * BLOCK_N, s_sn, cols, cmask, BN, BK, ROW_UNIFORM)
            prod = _chunk_prod(w, s, x_row, NW, rstd, cols, cmask, act, ROW_UNIFORM, BITS_CVT, NORM)
            if REDUCE_EACH:
                acc_rows += tl.sum(prod, axis=1)
            else:
                acc += prod
        if REDUCE_EACH:
            out = acc_rows
        else:
            out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(BIAS + rows, mask=rmask, other=0.0).to(tl.float32)
        if HAS_RES:  # residual + y, y rounded first as the unfused add sees it
            out = out.to(act).to(tl.float32) + tl.load(RES + r * s_rr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(Y + r * s_yr + rows, out.to(act), mask=rmask)
        trigger(PDL)  # pdl.py: the late form triggers here


# Tile config: (BLOCK_N, BLOCK_K, num_warps). BLOCK_N is picked per call for enough programs to fill the
# GPU (~16 per SM); TUNE lets bench/fp8_gemv_sweep.py sweep the others on the real device. Defaults from
# that sweep on one H200 (2026-12-01, ten Llama-8B and DeepSeek-V3 GEMV shapes): BLOCK_K 1024 with the
# accumulator reduced every chunk, 4 warps, summed 219.7 us against 239.7 for the earlier BLOCK_K 512 tile
# (more bytes in flight per program); the bit-arithmetic conversion and deeper pipelining gained nothing.
# bits_cvt: e4m3 -> fp16 by bit arithmetic instead of the convert instruction; reduce_each: reduce every K chunk
# (needed for block_k >= 1024); num_stages: Triton's software pipelining of the chunk loads.
# block_k_norm: the chunk of launch_fused's launches with the norm in their prologue (0: block_k): 2048 from
# `bench/fp8_gemv_sweep.py --fused` on one H100 (2026-12-05): G1 11.5 -> 10.2 us (GLM-5.1) and 11.8 -> 11.0
# (DeepSeek-V3), G2 15.5 -> 15.1 and 19.6 -> 18.7 (half as many trips through the loop after the row's rstd pass);
# the residual-epilogue wo and the plain launches were no faster with it.
# short_k / short_rows / short_block_n / short_block_k: a norm launch over K <= short_k with at least short_rows rows (the
# attention's G2, q_b over q_lora_rank: GLM-5.1 16384 x 2048, DeepSeek-V3 24576 x 1536) takes 16-row programs and
# 1024-wide chunks. Off (short_k 0) until measured in the step: alone, `bench/fp8_gemv_sweep.py --fused` on one H200
# (2026-12-06) gave GLM-5.1 13.7 -> 12.6 us and DeepSeek-V3 17.9 -> 16.1 (the picked 8 rows and the norm chunk 2048,
# against 16 and 1024), one H100 (2026-12-05) 15.1 -> 15.0 and 18.7 -> 18.2. In the step on one H100 (2026-12-07,
# GLM-5.1 fp8 78L 1K) it was not faster: 17.44 ms/token against 17.33-17.42 with the picked tile, so it stays off; the
# H200, where it gained most alone, has not run the step with it (`bash bench/depth_step.sh ab OUT 330 g2
# TILEPD_FP8_NORM_SHORT_K=2048`). A TP8 rank's G2 (2048-6144 rows) keeps the
# picked tile either way: 16 rows would leave it fewer programs than SMs at 1K.
# preload_k: the columns a launch_fused program loads before PDL's wait where its site preloads (pdl.PRELOAD): 0, one
# chunk (G1 and G2 2048, wo 1024 columns). 2048 gives wo two chunks: on one H100 (2026-12-07) GLM-5.1 fp8 78L 1K
# 16.97-17.00 -> 16.80 ms/token and the TP8 shard 5.19 -> 5.15, but DeepSeek-V3 fp8 15.58 -> 16.16-16.20, so it stays
# 0; 4096 (wo four chunks at 128 registers, G1 two) was slower on GLM-5.1 (18.32 against 17.80, both with the down
# kernel's preload, itself measured slower and not kept).
TUNE: dict[str, int] = {"block_k": 1024, "num_warps": 4, "programs": 16 * 132, "block_n": 0, "bits_cvt": 0, "reduce_each": 1,
                        "num_stages": 0, "block_k_norm": env_int("TILEPD_FP8_BLOCK_K_NORM", 2048),
                        "short_k": env_int("TILEPD_FP8_NORM_SHORT_K", 0), "short_rows": 8192, "short_block_n": 16, "short_block_k": 1024,
                        "preload_k": env_int("TILEPD_FP8_PRELOAD_K", 0)}
if TUNE["preload_k"] & (TUNE["preload_k"] - 1):
    raise ValueError(f"TILEPD_FP8_PRELOAD_K={TUNE['preload_k']}: a power of two (the columns loaded before PDL's wait), or 0 for one chunk")


def _preload_k(tile_k: int, k: int, reduce_each: bool) -> int:
    """The columns a program loads before PDL's wait: one K chunk, or TUNE's preload_k columns where that is more (a
    power of two; at most K rounded up), which only a [BLOCK_N] accumulator takes (a [BLOCK_N, BLOCK_K] one sums per
    chunk)."""
    if not reduce_each:
        return tile_k
    return max(tile_k, min(TUNE["preload_k"], triton.next_power_of_2(k)))


def _block_n(n: int, rows: int) -> int:
    return pick_block_n(n, rows, forced=TUNE["block_n"], programs=TUNE["programs"], smallest=8)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same strides where a dim is longer than 1: a kernel reading `a` through `b`'s strides reads
    it right (a size-1 dim's stride never moves a pointer, and TP shards or slices leave arbitrary ones there)."""
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, bias: torch.Tensor | None,
           block_n: int, block_k: int, shared: tuple[torch.Tensor, torch.Tensor] | None = None, x_div: int = 1) -> torch.Tensor:
    """x [R, K]; weight [N, K] (or [E, N, K] with ids [R]); scale [(E,) nb_n, nb_k] float32 -> [R, N] in x's dtype.
    Experts only: `shared` (weight [N, K], scale [nb_n, nb_k]) is read by rows whose id is -1 (the shared expert in
    the routed experts' launch), and x_div > 1 gives row r the activation x[r // x_div] (x [R / x_div, K])."""
    if triton is None:
        raise RuntimeError("fp8 GEMV kernel needs Triton, which is not importable here")
    if (shared is not None or x_div != 1) and ids is None:
        raise ValueError("fp8 GEMV kernel: shared and x_div are for stacked experts (ids given)")
    rows, k = x.shape[0] * x_div, x.shape[1]
    if ids is not None and ids.shape[0] != rows:
        raise ValueError(f"fp8 GEMV kernel: ids {list(ids.shape)} do not fit x {list(x.shape)} with x_div {x_div}")
    n = weight.shape[-2]
    if weight.stride(-1) != 1 or x.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("fp8 GEMV kernel: weight, scale and x must be contiguous along K")
    if shared is not None and any(not same_layout(a, b[0]) or a.dtype != b.dtype for a, b in ((shared[0], weight), (shared[1], scale))):
        raise ValueError(f"fp8 GEMV kernel: shared expert {list(shared[0].shape)} (scales {list(shared[1].shape)}) must match one routed "
                         f"expert {list(weight.shape[1:])} (scales {list(scale.shape[1:])}) in shape, strides and dtype")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    tile_n = _block_n(n, rows)
    tile_k = min(TUNE["block_k"], triton.next_power_of_2(k))
    has_ids = ids is not None
    grid = (rows, triton.cdiv(n, tile_n))
    bits = bool(TUNE["bits_cvt"])
    extra = {"num_stages": TUNE["num_stages"]} if TUNE["num_stages"] else {}
    _fp8_gemv_kernel[grid](
        x, weight.view(torch.uint8) if bits else weight, scale,
        (shared[0].view(torch.uint8) if bits else shared[0]) if shared is not None else x, shared[1] if shared is not None else x,
        ids if has_ids else x, bias if bias is not None else x, y, n, k,
        x.stride(0), weight.stride(0) if has_ids else 0, weight.stride(-2), scale.stride(0) if has_ids else 0, scale.stride(-2), y.stride(0),
        BN=block_n, BK=block_k, HAS_IDS=has_ids, HAS_BIAS=bias is not None, BLOCK_N=tile_n, BLOCK_K=tile_k,
        ROW_UNIFORM=block_n % tile_n == 0, BITS_CVT=bits, REDUCE_EACH=bool(TUNE["reduce_each"]) or tile_k >= 1024,
        HAS_SHARED=shared is not None, X_DIV=x_div, NW=x, RES=x, eps=0.0, s_rr=0, NORM=False, HAS_RES=False,
        PREFETCH=pdl.prefetch_flag(x) and not has_ids and tile_k >= 128,
        num_warps=TUNE["num_warps"], **extra, **pdl.launch_args(x),
    )
    return y


def fused_tile(n: int, k: int, rows: int, norm: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a launch_fused GEMV of n outputs over k: a norm launch over a short K with many rows takes
    TUNE's short tile (G2), any other norm launch the norm chunk, the rest block_k; BLOCK_N as picked to fill the GPU."""
    if norm and 0 < k <= TUNE["short_k"] and n >= TUNE["short_rows"]:
        return TUNE["short_block_n"], min(TUNE["short_block_k"], triton.next_power_of_2(k))
    return _block_n(n, rows), min((norm and TUNE["block_k_norm"]) or TUNE["block_k"], triton.next_power_of_2(k))


def launch_fused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], *, rows: int | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                 site: str = "gemv") -> torch.Tensor:
    """The dense (no expert ids) GEMV with the layer's small ops inside: y = (residual +) W[:rows] @ rms_norm(x) * g.

    x [R, K]; weight [N, K] fp8 with block scales; `rows` computes only the first rows of W (a prefix of a
    concatenated weight: DSA's indexer query rows are not needed while the window fits index_topk); `norm_weight`
    puts rms_norm(x, norm_weight, eps) in the prologue (each program sums x's squares itself); `residual` [R, rows]
    is added in the epilogue. Rounding as the unfused ops: the normed row and the product with the norm weight in
    x's dtype, the GEMV's output in x's dtype before the add. `site`: the launch's PDL site (pdl.SITES)."""
    if triton is None:
        raise RuntimeError("fp8 GEMV kernel needs Triton, which is not importable here")
    n = weight.shape[0] if rows is None else rows
    r, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k or not 0 < n <= weight.shape[0]:
        raise ValueError(f"fp8 fused GEMV: weight {list(weight.shape)} (rows {rows}) does not fit x {list(x.shape)}")
    if weight.stride(-1) != 1 or x.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("fp8 fused GEMV: weight, scale and x must be contiguous along K")
    if residual is not None and (tuple(residual.shape) != (r, n) or residual.stride(-1) != 1):
        raise ValueError(f"fp8 fused GEMV: residual {list(residual.shape)}, expected [{r}, {n}] contiguous")
    if norm_weight is not None and tuple(norm_weight.shape) != (k,):
        raise ValueError(f"fp8 fused GEMV: norm weight {list(norm_weight.shape)}, expected [{k}]")
    y = torch.empty(r, n, dtype=x.dtype, device=x.device)
    tile_n, tile_k = fused_tile(n, k, r, norm_weight is not None)
    reduce_each = bool(TUNE["reduce_each"]) or tile_k >= 1024
    bits = bool(TUNE["bits_cvt"])
    extra = {"num_stages": TUNE["num_stages"]} if TUNE["num_stages"] else {}
    _fp8_gemv_kernel[(r, triton.cdiv(n, tile_n))](
        x, weight.view(torch.uint8) if bits else weight, scale, x, x, x, x, y, n, k,
        x.stride(0), 0, weight.stride(0), 0, scale.stride(0), y.stride(0),
        BN=block[0], BK=block[1], HAS_IDS=False, HAS_BIAS=False, BLOCK_N=tile_n, BLOCK_K=tile_k,
        ROW_UNIFORM=block[0] % tile_n == 0, BITS_CVT=bits, REDUCE_EACH=reduce_each,
        HAS_SHARED=False, X_DIV=1, NW=norm_weight if norm_weight is not None else x, RES=residual if residual is not None else x,
        eps=eps, s_rr=residual.stride(0) if residual is not None else 0, NORM=norm_weight is not None, HAS_RES=residual is not None,
        PREFETCH=pdl.prefetch_flag(x, site=site) and tile_k >= 128,
        PRELOAD_K=_preload_k(tile_k, k, reduce_each) if pdl.preload_flag(x, site=site) else 0,
        num_warps=TUNE["num_warps"], **extra, **pdl.launch_args(x, site=site),
    )
    return y


def _reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, bias: torch.Tensor | None,
               block_n: int, block_k: int) -> torch.Tensor:
    from tilepd.model_format.block_fp8 import BlockFp8, dequantize

    w = BlockFp8(weight, scale, (block_n, block_k))
    if ids is None:
        return torch.nn.functional.linear(x, dequantize(w, x.dtype), bias)
    y = torch.einsum("ri,roi->ro", x, dequantize(w[ids], x.dtype))
    return y if bias is None else y + bias


@torch.library.custom_op("tilepd::fp8_gemv", mutates_args=())
def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, bias: torch.Tensor | None,
             block_n: int, block_k: int) -> torch.Tensor:
    """[R, N] = per row r: x[r] @ dequant(weight (expert ids[r] when given)).T (+ bias); float32 accumulation."""
    if x.is_cuda and triton is not None:
        return launch(x.contiguous(), weight, scale, ids, bias, block_n, block_k)
    return _reference(x, weight, scale, ids, bias, block_n, block_k)


@fp8_gemv.register_fake
def _(x, weight, scale, ids, bias, block_n, block_k):  # noqa: ANN001, ANN202 - the op's shapes for torch.compile
    return x.new_empty(x.shape[0], weight.shape[-2])
