"""MLA decode attention in Triton (absorbed form, dense or DSA-sparse), split over the context.

Why: K and V of MLA are the same cache row (latent c [rank] + roped k_pe [rope]; V = c), shared by all
heads. Generic kernels (SDPA, attention.py's split-KV) see 576-wide K and 512-wide V as two tensors and a
[H*T, L] bias, and on CUDA SDPA does not even take the 576-wide path efficiently: a dsv3-shaped step spent
most of its time there. Here one program takes BLOCK_H query heads of one token and a chunk of the cache:
each row is loaded once as [latent | rope], scored against q_lat and q_pe, and its latent is reused as V.
Programs of the same chunk differ only in their head group and are launched side by side (head groups
are the fast grid axis), so a row comes from HBM once per step and from L2 for the other head groups.
The chunks' partial results are merged by their log-sum-exp in a second small kernel (flash-decoding),
with enough chunks that a batch-1 step fills the GPU at 1K..128K context.

Dense mode: token t sees cache slots lo[t]..hi[t] (inclusive) of the window [0, L): hi is the token's
position (causal), lo 0 (or the first slot an MTP layer wrote). Chunks outside that span load nothing.
Sparse mode (DSA): token t sees the slots idx[t, :] whose ok[t, :] is set (dsa.Selection); rows are
gathered by index. Static shapes, no host sync: both run inside a CUDA graph.

Only imported where Triton is; the CPU reference is dsa.sparse_mla_attention / layers.cached_attention.
Tile sizes are in TUNE (env TILEPD_MLA_BLOCK_N, _BLOCK_H, _NUM_WARPS, _NUM_STAGES, _PROGRAMS override them),
TUNE_LONG (dense windows from TILEPD_MLA_LONG_FROM rows, env TILEPD_MLA_LONG_*) and TUNE_SPARSE (TILEPD_MLA_SPARSE_*),
so bench/decode_speed.py --sweep and bench/mla_dense_long.py can try configurations in one command.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tilepd.engine import pdl
from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
    from tilepd.engine.pdl import trigger, wait
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# block_n: cache rows per loop iteration; block_h: query heads per program; programs: how many programs a
# step aims for (~2 waves of the H200's 132 SMs); min_blocks: fewest loop iterations per chunk (fewer
# chunks means less partial-result traffic to merge).
# Defaults from `bench/decode_speed.py --sweep` on one H200 (2026-11-30, docs/PERFORMANCE.md): dense MLA over
# 128 heads was fastest with 64-row blocks, 32 heads per program, 4 warps and ~one wave of programs (8K: 22.7 us
# against 33.2 us for the first guess of 32/32/8 warps/2 waves; 32K: 66.0 against 97.7 us); DSA's gather of
# 2048 selected rows over 64 heads with 32-row blocks, 16 heads per program, 4 warps (16.7 against 22.4 us).
# TUNE_SPARSE also serves a DSA model's window while it fits index_topk (mla_fused reads that full selection as a
# span, SPARSE=False): the tiles of DSA's shapes (64 heads, at most index_topk rows), with or without indices.
# min_blocks 1 (was 4) from `bench/mla_fused_gpu.py`'s sweep on one H200 (2026-12-03, bench/results/
# mla-fused-gpu_h200_2026-12-03b.json): at short windows one iteration per program fills the 132 SMs (GLM-5.1 1K
# 21.2 -> 13.7 us, DeepSeek-V3 1K 25.0 -> 15.0 us, 2048 of 32K selected 20.8 -> 15.9 us, split + merge timed together).
TUNE: dict[str, int] = {
    "block_n": env_int("TILEPD_MLA_BLOCK_N", 64),
    "block_h": env_int("TILEPD_MLA_BLOCK_H", 32),
    "num_warps": env_int("TILEPD_MLA_NUM_WARPS", 4),
    "num_stages": env_int("TILEPD_MLA_NUM_STAGES", 2),
    "programs": env_int("TILEPD_MLA_PROGRAMS", 132),
    "min_blocks": env_int("TILEPD_MLA_MIN_BLOCKS", 1),
}
# TUNE_LONG: dense MLA over a long window (length >= its "from"), where the kernel is no longer latency-bound: all
# heads share each cache row, so 128 heads make a window of L rows ~2.2 * L * 576 * 128 FLOPs (DeepSeek-V3 at 32K: 9
# GFLOPs a layer, against 38 MB of rows), and TUNE's 32-head programs run their dots as mma.sync from registers and spill
# (sm_90 resource report: 255 registers + 124 B a thread); 64-head programs of 8 warps build as wgmma. Picked by
# `bench/mla_dense_long.py` on an H100 (2026-12-06, 20 tile x policy rows, split + merge_uv, caches past the L2): 64
# heads, 64-row blocks, 8 warps, 2 stages: 77.5 -> 62.9 us at 32K, 237.9 -> 168.2 at 128K, but slower than TUNE at 4K
# and 8K (26.2 / 33.4 against 21.4 / 30.6 us), hence from 32K; DeepSeek-V3 fp8 61 layers at 32K 19.33 -> 18.78 ms/token.
# Measured and removed (one H200, 2026-12-06, docs/PERFORMANCE.md): V split over 2-4 programs of a head group and chunk,
# each scoring the whole row for a [heads, rank / n] accumulator. 64-head tiles ran out of shared memory with V's own
# load, the tiles that built took 121-138 us at 32K against this tile's 59, and at short windows nothing beat TUNE /
# TUNE_SPARSE by more than ~0.6 us.
TUNE_LONG: dict[str, int] = {
    "from": env_int("TILEPD_MLA_LONG_FROM", 32768),
    "block_n": env_int("TILEPD_MLA_LONG_BLOCK_N", 64),
    "block_h": env_int("TILEPD_MLA_LONG_BLOCK_H", 64),
    "num_warps": env_int("TILEPD_MLA_LONG_NUM_WARPS", 8),
    "num_stages": env_int("TILEPD_MLA_LONG_NUM_STAGES", 2),
    "programs": env_int("TILEPD_MLA_LONG_PROGRAMS", 132),
    "min_blocks": env_int("TILEPD_MLA_LONG_MIN_BLOCKS", 1),
}
TUNE_SPARSE: dict[str, int] = {
    "block_n": env_int("TILEPD_MLA_SPARSE_BLOCK_N", 32),
    "block_h": env_int("TILEPD_MLA_SPARSE_BLOCK_H", 16),
    "num_warps": env_int("TILEPD_MLA_SPARSE_NUM_WARPS", 4),
    "num_stages": env_int("TILEPD_MLA_SPARSE_NUM_STAGES", 2),
    "programs": env_int("TILEPD_MLA_SPARSE_PROGRAMS", 132),
    "min_blocks": env_int("TILEPD_MLA_SPARSE_MIN_BLOCKS", 1),
}


def available() -> bool:
    return triton is not None


def supports(rank: int, rope: int) -> bool:
    """Power-of-two latent and rope widths (tl.arange), as DeepSeek-V3/GLM-5 have (512, 64)."""
    return available() and all(d >= 16 and d & (d - 1) == 0 for d in (rank, rope))


if triton is not None:

    @triton.jit
    def _mla_split_kernel(Q, C, IDX, OK, LO, HI, O, LSE, H, L, CHUNK, qk_scale,
                          s_qt, s_qh, s_cl, s_it, s_ot, s_oh, s_os, s_lt, s_lh,
                          RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          SPARSE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False):
        wait(PDL)  # everything this kernel reads (query, cache, selection) is the step's (pdl.py)
        _split_item(tl.program_id(0), tl.program_id(1), Q, C, IDX, OK, LO, HI, O, LSE, H, L, CHUNK, qk_scale,
                    s_qt, s_qh, s_cl, s_it, s_ot, s_oh, s_os, s_lt, s_lh, RANK, ROPE, BLOCK_H, BLOCK_N, SPARSE, PRECISION, UPCAST)
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _split_item(pid, s, Q, C, IDX, OK, LO, HI, O, LSE, H, L, CHUNK, qk_scale,
                    s_qt, s_qh, s_cl, s_it, s_ot, s_oh, s_os, s_lt, s_lh,
                    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPARSE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """Head group pid (token pid // groups) over chunk s: the split kernel runs one a program, the persistent core
        (mla_core_triton) loops over them."""
        n_hg = tl.cdiv(H, BLOCK_H)
        t = pid // n_hg
        offs_h = (pid % n_hg) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_r = tl.arange(0, RANK)
        offs_p = tl.arange(0, ROPE)
        q_rows = Q + t * s_qt + offs_h[:, None] * s_qh
        q_lat = tl.load(q_rows + offs_r[None, :], mask=hmask[:, None], other=0.0)
        q_pe = tl.load(q_rows + RANK + offs_p[None, :], mask=hmask[:, None], other=0.0)
        if UPCAST:  # Triton's CPU interpreter gets bf16 tl.dot wrong: compute in fp32 there
            q_lat = q_lat.to(tl.float32)
            q_pe = q_pe.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, L)
        if not SPARSE:  # only the token's visible span [lo, hi] of this chunk is read
            start = tl.maximum(start, tl.load(LO + t).to(tl.int32))
            end = tl.minimum(end, tl.load(HI + t).to(tl.int32) + 1)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            if SPARSE:
                slot = tl.load(IDX + t * s_it + offs_n, mask=nmask, other=0).to(tl.int64)
                nmask = nmask & (tl.load(OK + t * s_it + offs_n, mask=nmask, other=0) != 0)
            else:
                slot = offs_n.to(tl.int64)
            rows = C + slot[:, None] * s_cl
            kv = tl.load(rows + offs_r[None, :], mask=nmask[:, None], other=0.0)  # latent: K part and V
            kpe = tl.load(rows + RANK + offs_p[None, :], mask=nmask[:, None], other=0.0)
            if UPCAST:
                kv = kv.to(tl.float32)
                kpe = kpe.to(tl.float32)
            qk = tl.dot(q_lat, tl.trans(kv), input_precision=PRECISION)
            qk = tl.dot(q_pe, tl.trans(kpe), acc=qk, input_precision=PRECISION)
            qk = tl.where(nmask[None, :], qk * qk_scale, float("-inf"))  # log2 units
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
            m_i = m_new
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / safe_l[:, None]
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(O + t * s_ot + offs_h[:, None] * s_oh + s * s_os + offs_r[None, :], out, mask=hmask[:, None])
        tl.store(LSE + t * s_lt + offs_h * s_lh + s, lse, mask=hmask)

    @triton.jit
    def _mla_merge_kernel(O, LSE, OUT, S, H, s_ot, s_oh, s_os, s_lt, s_lh, s_pt, s_ph,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        wait(PDL)
        row = tl.program_id(0)
        t = row // H
        h = row % H
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        smask = offs_s < S
        lse = tl.load(LSE + t * s_lt + h * s_lh + offs_s, mask=smask, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - mx))
        o = tl.load(O + t * s_ot + h * s_oh + offs_s[:, None] * s_os + offs_d[None, :], mask=smask[:, None], other=0.0)
        den = tl.sum(w, axis=0)
        res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
        tl.store(OUT + t * s_pt + h * s_ph + offs_d, res.to(OUT.dtype.element_ty))
        trigger(PDL)  # pdl.py: the late form triggers here


def split_partials(q: torch.Tensor, cache: torch.Tensor, rank: int, scale: float, length: int, *, idx: torch.Tensor | None = None,
                   ok: torch.Tensor | None = None, lo: torch.Tensor | None = None,
                   hi: torch.Tensor | None = None, tune: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel alone: (partials [T, H, S, rank] float32, their log-sum-exp [T, H, S] in log2 units), for a
    merge that does more than merge (mla_fused_triton.merge_uv applies W_UV in the same launch). tune: the tiles
    (default TUNE_SPARSE with idx, else TUNE_LONG for a window of at least its "from" rows, else TUNE; a DSA model's
    span while its window fits index_topk takes TUNE_SPARSE)."""
    if triton is None:
        raise RuntimeError("MLA attention kernel needs Triton, which is not importable here")
    plan = split_plan(q, cache, rank, scale, length, idx=idx, ok=ok, lo=lo, hi=hi, tune=tune)
    _mla_split_kernel[(plan.groups, plan.splits)](*plan.args, **plan.constexprs, num_warps=plan.tune["num_warps"],
                                                  num_stages=plan.tune["num_stages"], **pdl.launch_args(plan.q, "split"))
    return plan.part, plan.lse


@dataclass
class SplitPlan:
    """One split-KV launch's work, laid out: grid (groups, splits), its arguments in the kernel's order (args: the
    tensors, sizes and strides; constexprs: the tiles), the partials it writes and the tiles' tune entry."""

    q: torch.Tensor
    part: torch.Tensor
    lse: torch.Tensor
    groups: int
    splits: int
    args: tuple
    constexprs: dict
    tune: dict[str, int]


def split_plan(q: torch.Tensor, cache: torch.Tensor, rank: int, scale: float, length: int, *, idx: torch.Tensor | None = None,
               ok: torch.Tensor | None = None, lo: torch.Tensor | None = None, hi: torch.Tensor | None = None,
               tune: dict[str, int] | None = None) -> SplitPlan:
    """split_partials' layout, without the launch (the persistent core, mla_core_triton, runs the same items)."""
    t, h, width = q.shape
    rows = cache.reshape(cache.shape[0], -1)  # [max_seq_len, 1, W] -> [max_seq_len, W] view
    if rows.shape[1] != width or rows.stride(1) != 1:
        raise ValueError(f"MLA kernel: cache rows {tuple(cache.shape)} (stride {cache.stride()}) do not match the query width {width}")
    rope = width - rank
    if not supports(rank, rope):
        raise ValueError(f"MLA kernel: latent {rank} and rope {rope} must be powers of two >= 16")
    q = q.to(cache.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if tune is None:
        tune = TUNE_SPARSE if idx is not None else TUNE_LONG if length >= TUNE_LONG["from"] else TUNE
    block_n, block_h = tune["block_n"], max(16, min(tune["block_h"], triton.next_power_of_2(h)))
    groups = t * triton.cdiv(h, block_h)
    want = max(1, tune["programs"] // groups)
    chunk = max(block_n * tune["min_blocks"], triton.cdiv(triton.cdiv(length, want), block_n) * block_n)
    splits = triton.cdiv(length, chunk)
    part = torch.empty(t, h, splits, rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, h, splits, dtype=torch.float32, device=q.device)
    sparse = idx is not None
    dummy = part
    args = (q, rows, idx if sparse else dummy, ok.view(torch.uint8) if sparse else dummy, lo if not sparse else dummy,
            hi if not sparse else dummy, part, lse, h, length, chunk, scale * _LOG2E,
            q.stride(0), q.stride(1), rows.stride(0), idx.stride(0) if sparse else 0,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    constexprs = {"RANK": rank, "ROPE": rope, "BLOCK_H": block_h, "BLOCK_N": block_n, "SPARSE": sparse,
                  "UPCAST": _INTERPRET and cache.dtype != torch.float32, "PRECISION": "ieee" if cache.dtype == torch.float32 else "tf32"}
    return SplitPlan(q, part, lse, groups, splits, args, constexprs, tune)


def _launch(q: torch.Tensor, cache: torch.Tensor, rank: int, scale: float, length: int, *, idx: torch.Tensor | None = None,
            ok: torch.Tensor | None = None, lo: torch.Tensor | None = None, hi: torch.Tensor | None = None) -> torch.Tensor:
    part, lse = split_partials(q, cache, rank, scale, length, idx=idx, ok=ok, lo=lo, hi=hi)
    t, h, splits, _ = part.shape
    out = torch.empty(t, h, rank, dtype=cache.dtype, device=q.device)
    block_d = min(rank, 128)
    _mla_merge_kernel[(t * h, rank // block_d)](
        part, lse, out, splits, h, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4,
        **pdl.launch_args(part, "merge"))
    return out


def mla_dense_attention(q: torch.Tensor, cache: torch.Tensor, rank: int, lo: torch.Tensor, hi: torch.Tensor, length: int,
                        scale: float) -> torch.Tensor:
    """q [T, H, rank + rope] (q_lat | q_pe); cache [max_seq_len, 1, rank + rope]; token t attends to slots
    lo[t]..hi[t] (inclusive, clipped to the window [0, length)). Returns the weighted latent [T, H, rank]
    in the cache dtype (what layers.cached_attention(q, window, window[..., :rank], bias) returns)."""
    if lo.stride(0) != 1 or hi.stride(0) != 1:
        lo, hi = lo.contiguous(), hi.contiguous()
    return _launch(q, cache, rank, scale, length, lo=lo, hi=hi)


def mla_sparse_attention(q: torch.Tensor, cache: torch.Tensor, rank: int, idx: torch.Tensor, ok: torch.Tensor, scale: float) -> torch.Tensor:
    """DSA: token t attends to the slots idx[t, k] with ok[t, k] set (dsa.Selection). Same result as
    dsa.sparse_mla_attention, without the [T, K, rank + rope] gathered copy."""
    if idx.stride(-1) != 1 or ok.stride(-1) != 1 or idx.stride(0) != ok.stride(0):
        idx, ok = idx.contiguous(), ok.contiguous()
    return _launch(q, cache, rank, scale, idx.shape[1], idx=idx, ok=ok)
