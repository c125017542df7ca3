"""Split-KV ("flash-decoding") attention for few queries over a long static cache, in Triton (CUDA only).

Why: at batch 1 a decode step has only Hkv x (group * T) query rows, so one program per KV head (what
SDPA's kernels launch) leaves most SMs idle while the cache is read; at 8K context that read is ~0.27 ms
of a Llama-3-8B step and the idle SMs made it ~1 ms. Here the cache window is cut into chunks, one
program per (KV head, chunk) reads its chunk once with an online softmax, and a second tiny kernel merges
the chunks by their log-sum-exp. Blocks whose additive bias is all -inf (past the live prefix inside a
bucketed window) are skipped without reading K/V, so a window larger than the prefix costs little.

Same contract as `layers.cached_attention` (q [T, H, Dk], k/v strided cache views [L, Hkv, D], bias
[g*T, L] with rows ordered (group member, token)); only imported on CUDA, so CPU installs need no Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TARGET_PROGRAMS = 2 * 132  # ~2 waves on an H200 (132 SMs); more splits only add merge work


@triton.jit
def _split_kernel(Q, K, V, B, O, LSE, L, M, CHUNK, scale,
                  s_qh, s_qm, s_kl, s_kh, s_vl, s_vh, s_bm, s_oh, s_os, s_om, s_lh, s_ls,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0)
    s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    mmask = offs_m < M
    q = tl.load(Q + h * s_qh + offs_m[:, None] * s_qm + offs_dk[None, :], mask=mmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    start = s * CHUNK
    end = tl.minimum(start + CHUNK, L)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        b = tl.load(B + offs_m[:, None] * s_bm + offs_n[None, :], mask=mmask[:, None] & nmask[None, :], other=float("-inf"))
        b = b.to(tl.float32)
        if tl.max(tl.max(b, axis=1), axis=0) > float("-inf"):  # skip blocks no query row can see
            k = tl.load(K + h * s_kh + offs_n[:, None] * s_kl + offs_dk[None, :], mask=nmask[:, None], other=0.0)
            v = tl.load(V + h * s_vh + offs_n[:, None] * s_vl + offs_dv[None, :], mask=nmask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + b
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.log(safe_l), float("-inf"))
    tl.store(O + h * s_oh + s * s_os + offs_m[:, None] * s_om + offs_dv[None, :], out, mask=mmask[:, None])
    tl.store(LSE + h * s_lh + s * s_ls + offs_m, lse, mask=mmask)


@triton.jit
def _merge_kernel(O, LSE, OUT, S, M, s_oh, s_os, s_om, s_lh, s_ls, s_ph, s_pm,
                  BLOCK_S: tl.constexpr, DV: tl.constexpr):
    row = tl.program_id(0)
    h = row // M
    m = row % M
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, DV)
    smask = offs_s < S
    lse = tl.load(LSE + h * s_lh + offs_s * s_ls + m, mask=smask, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - mx))
    o = tl.load(O + h * s_oh + offs_s[:, None] * s_os + m * s_om + offs_d[None, :], mask=smask[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(OUT + h * s_ph + m * s_pm + offs_d, res.to(OUT.dtype.element_ty))


def supports(dk: int, dv: int) -> bool:
    """Power-of-two head dims (tl.arange); others stay on SDPA."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                       block_n: int = 64) -> torch.Tensor:
    """Drop-in for `layers.cached_attention` on CUDA (see the module docstring). Returns [T, H, Dv]."""
    t, h, dk = q.shape
    length, hkv, dv = v.shape
    g = h // hkv
    m = g * t
    qg = q.view(t, hkv, g, dk).permute(1, 2, 0, 3).reshape(hkv, m, dk).to(k.dtype).contiguous()
    bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    chunk = max(block_n, triton.cdiv(triton.cdiv(length * hkv, _TARGET_PROGRAMS), block_n) * block_n)
    splits = triton.cdiv(length, chunk)
    part = torch.empty(hkv, splits, m, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(hkv, splits, m, dtype=torch.float32, device=q.device)
    out = torch.empty(hkv, m, dv, dtype=k.dtype, device=q.device)
    block_m = max(16, triton.next_power_of_2(m))
    _split_kernel[(hkv, splits)](
        qg, k, v, bias, part, lse, length, m, chunk, scale,
        qg.stride(0), qg.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), bias.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, DK=dk, DV=dv, PRECISION="ieee" if k.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    _merge_kernel[(hkv * m,)](
        part, lse, out, splits, m, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), BLOCK_S=max(2, triton.next_power_of_2(splits)), DV=dv, num_warps=4)
    return out.view(hkv, g, t, dv).permute(2, 0, 1, 3).reshape(t, h, dv)
