"""DSA's lightning indexer in two Triton kernels: the new keys' LayerNorm + RoPE + cache write, and the scores.

Why: the reference (dsa.select_topk) spends a dozen small launches a layer around two GEMVs: layer_norm, the
RoPE's flip/mul/addcmul, two cats, index_copy, the q.k matmul, relu, scale, the head-weighted sum and
masked_fill, each writing a [T, H, L] or [T, L] intermediate. Here
  * write_index_keys: LayerNorm (weight, bias, eps 1e-6) of wk . h, RoPE on the first `rope` channels and the
    store at the token's cache slot, one program per token;
  * index_scores: each program takes a block of cached keys, read once, and for every query row ropes q by
    index arithmetic (no cat), computes relu(q.k * d^-0.5) for all heads with one tl.dot, weights the heads
    (fp32 weights times n_heads^-0.5) and sums them, writing -inf where `valid` is not set: [T, L] float32,
    what dsa_topk.topk_select reads.
RoPE layouts as dsa.py describes (GPT-J pairs when interleaved, NeoX half-split otherwise); cs [T, 2, rope] is
the rope table's rows at the tokens' positions (cos, signed sin). Static shapes, no host sync.
"""

from __future__ import annotations

import os

import torch

from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# block_l: cached keys per program of the scores kernel.
TUNE: dict[str, int] = {
    "block_l": env_int("TILEPD_DSA_SCORE_BLOCK_L", 64),
    "num_warps": env_int("TILEPD_DSA_SCORE_NUM_WARPS", 4),
    "num_stages": env_int("TILEPD_DSA_SCORE_NUM_STAGES", 2),
}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _rope_partner(offs, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        """The channel whose value RoPE pairs with each channel (itself past the roped part)."""
        if INTERLEAVED:
            partner = offs ^ 1
        else:
            partner = (offs + ROPE // 2) % ROPE
        return tl.where(offs < ROPE, partner, offs)

    @triton.jit
    def _index_key_kernel(KX, NW, NB, CS, POS, CACHE, eps, s_kt, s_ct, s_c1, s_cl,
                          D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, D)
        partner = _rope_partner(offs, ROPE, INTERLEAVED)
        x = tl.load(KX + t * s_kt + offs).to(tl.float32)
        mean = tl.sum(x, axis=0) / D
        var = tl.sum((x - mean) * (x - mean), axis=0) / D
        rstd = 1.0 / tl.sqrt(var + eps)
        y = (x - mean) * rstd * tl.load(NW + offs).to(tl.float32) + tl.load(NB + offs).to(tl.float32)
        xp = tl.load(KX + t * s_kt + partner).to(tl.float32)
        yp = (xp - mean) * rstd * tl.load(NW + partner).to(tl.float32) + tl.load(NB + partner).to(tl.float32)
        roped = offs < ROPE
        cos = tl.load(CS + t * s_ct + offs, mask=roped, other=1.0).to(tl.float32)
        sin = tl.load(CS + t * s_ct + s_c1 + offs, mask=roped, other=0.0).to(tl.float32)
        slot = tl.load(POS + t).to(tl.int64)
        tl.store(CACHE + slot * s_cl + offs, (y * cos + yp * sin).to(CACHE.dtype.element_ty))

    @triton.jit
    def _index_scores_kernel(Q, CS, WTS, KEYS, VALID, OUT, T, H, L, qk_scale, head_scale,
                             s_qt, s_qh, s_ct, s_c1, s_wt, s_kl, s_vt, s_ot,
                             D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_L: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        offs_l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        lmask = offs_l < L
        offs_d = tl.arange(0, D)
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        keys = tl.load(KEYS + offs_l.to(tl.int64)[:, None] * s_kl + offs_d[None, :], mask=lmask[:, None], other=0.0)
        if UPCAST:  # Triton's CPU interpreter gets bf16 tl.dot wrong: compute in fp32 there
            keys = keys.to(tl.float32)
        partner = _rope_partner(offs_d, ROPE, INTERLEAVED)
        roped = offs_d < ROPE
        for t in range(T):
            q_rows = Q + t * s_qt + offs_h[:, None] * s_qh
            q = tl.load(q_rows + offs_d[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
            qp = tl.load(q_rows + partner[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
            cos = tl.load(CS + t * s_ct + offs_d, mask=roped, other=1.0).to(tl.float32)
            sin = tl.load(CS + t * s_ct + s_c1 + offs_d, mask=roped, other=0.0).to(tl.float32)
            q = (q * cos[None, :] + qp * sin[None, :]).to(keys.dtype)
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_H, BLOCK_L]
            s = tl.maximum(s * qk_scale, 0.0)
            w = tl.load(WTS + t * s_wt + offs_h, mask=hmask, other=0.0) * head_scale
            score = tl.sum(s * w[:, None], axis=0)
            ok = tl.load(VALID + t * s_vt + offs_l, mask=lmask, other=0) != 0
            tl.store(OUT + t * s_ot + offs_l, tl.where(ok, score, float("-inf")), mask=lmask)


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("DSA indexer kernels need Triton, which is not importable here")


def write_index_keys(kx: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor, cs: torch.Tensor, positions: torch.Tensor,
                     cache: torch.Tensor, rope: int, interleaved: bool) -> None:
    """cache[positions[t]] = RoPE(LayerNorm(kx[t])) for kx [T, D] (wk . h), cache [max_seq_len, D]."""
    _need_triton()
    t, d = kx.shape
    if cache.shape[1] != d or cache.stride(1) != 1 or kx.stride(1) != 1 or cs.stride(2) != 1:
        raise ValueError(f"DSA index keys: kx {tuple(kx.shape)}, cache {tuple(cache.shape)} (stride {cache.stride()}), "
                         f"cs stride {cs.stride()}: need matching, contiguous rows")
    _index_key_kernel[(t,)](kx, norm_w, norm_b, cs, positions, cache, 1e-6, kx.stride(0), cs.stride(0), cs.stride(1), cache.stride(0),
                            D=d, ROPE=rope, INTERLEAVED=interleaved, num_warps=1)


def index_scores(q: torch.Tensor, cs: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                 rope: int, interleaved: bool) -> torch.Tensor:
    """[T, L] float32 indexer scores: sum_h weights[t, h] * n_heads^-0.5 * relu(rope(q[t, h]) . keys[l] * d^-0.5),
    -inf where valid [T, L] is not set. q [T, H, D] un-roped (wq_b . q_resid); weights [T, H] float32;
    keys: the cache (its first L rows are read)."""
    _need_triton()
    t, h, d = q.shape
    length = valid.shape[1]
    if keys.shape[1] != d or keys.stride(1) != 1 or q.stride(2) != 1 or cs.stride(2) != 1 or keys.shape[0] < length:
        raise ValueError(f"DSA index scores: q {tuple(q.shape)}, keys {tuple(keys.shape)} (stride {keys.stride()}), window {length}")
    if weights.dtype != torch.float32 or weights.shape != (t, h):
        raise ValueError(f"DSA index scores: weights {tuple(weights.shape)} {weights.dtype}, expected ({t}, {h}) torch.float32")
    if valid.stride(1) != 1:
        valid = valid.contiguous()
    weights = weights.contiguous()
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    block_l = TUNE["block_l"]
    _index_scores_kernel[(triton.cdiv(length, block_l),)](
        q, cs, weights, keys, valid.view(torch.uint8), out, t, h, length, d**-0.5, h**-0.5,
        q.stride(0), q.stride(1), cs.stride(0), cs.stride(1), weights.stride(0), keys.stride(0), valid.stride(0), out.stride(0),
        D=d, ROPE=rope, INTERLEAVED=interleaved, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_L=block_l,
        PRECISION="ieee" if keys.dtype == torch.float32 else "tf32", UPCAST=_INTERPRET and keys.dtype != torch.float32,
        num_warps=TUNE["num_warps"], num_stages=TUNE["num_stages"])
    return out
