"""DSA's lightning indexer in two Triton kernels: the new keys' LayerNorm + RoPE + cache write, and the scores.

Why: the reference (dsa.select_topk) spends a dozen small launches a layer around two GEMVs: layer_norm, the
RoPE's flip/mul/addcmul, two cats, index_copy, the q.k matmul, relu, scale, the head-weighted sum and
masked_fill, each writing a [T, H, L] or [T, L] intermediate. Here
  * write_index_keys: LayerNorm (weight, bias, eps 1e-6) of wk . h, RoPE on the first `rope` channels and the
    store at the token's cache slot, one program per token;
  * index_scores: each program takes one query row and a chunk of cached keys (score_chunk: about 2 programs a
    multiprocessor), ropes that row's q for all heads once by index arithmetic (no cat), then per block of keys
    computes relu(k.q * d^-0.5) for all heads with one tl.dot (each key row read once, not once per head block),
    weights the heads (fp32 weights times n_heads^-0.5) and sums them in registers, writing -inf where `valid` is
    not set: [T, L] float32, what dsa_topk.topk_select reads. Optionally its epilogue adds the histogram of the
    scores' top radix byte (the select's first pass) to the row's, so the select starts at its second byte.
  * index_topk: the scores with that histogram, then dsa_topk.topk_select from it (the speed path's call).
RoPE layouts as dsa.py describes (GPT-J pairs when interleaved, NeoX half-split otherwise); cs [T, 2, rope] is
the rope table's rows at the tokens' positions (cos, signed sin). Static shapes, no host sync.
"""

from __future__ import annotations

import os

import torch

from tilepd.engine import pdl

from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
    from tilepd.engine.pdl import trigger, wait
except Exception:  # pragma: no cover - CPU installs without Triton
    triton = None

# block_l: cached keys per iteration of the scores kernel (the dot's M); programs: about how many programs a row's
# keys are split over (each loops over score_chunk(L) keys with its q roped once; 2 a multiprocessor on an H200).
TUNE: dict[str, int] = {
    "block_l": env_int("TILEPD_DSA_SCORE_BLOCK_L", 128),
    "programs": env_int("TILEPD_DSA_SCORE_PROGRAMS", 264),
    "num_warps": env_int("TILEPD_DSA_SCORE_NUM_WARPS", 4),
    "num_stages": env_int("TILEPD_DSA_SCORE_NUM_STAGES", 3),
}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    from tilepd.engine.dsa_topk import _digit, _masked_hist, _ordered_key

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
                          D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
        wait(PDL)  # everything it reads is the step's (pdl.py)
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
        trigger(PDL)  # pdl.py: the late form triggers here

    @triton.jit
    def _index_scores_kernel(Q, CS, WTS, KEYS, VALID, OUT, HIST, H, L, CHUNK, qk_scale, head_scale,
                             s_qt, s_qh, s_ct, s_c1, s_wt, s_kl, s_vt, s_ot, s_ht,
                             D: tl.constexpr, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_L: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, WITH_HIST: tl.constexpr, PDL: tl.constexpr = False):
        wait(PDL)  # everything it reads is the step's (pdl.py)
        t = tl.program_id(0)  # the rows of one chunk are neighbours in launch order: its keys come from L2 for t > 0
        start = tl.program_id(1) * CHUNK
        end = tl.minimum(start + CHUNK, L)
        offs_d = tl.arange(0, D)
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        # q of every head roped once per program (index arithmetic, no cat), the head weights folded with n_heads^-0.5
        partner = _rope_partner(offs_d, ROPE, INTERLEAVED)
        roped = offs_d < ROPE
        q_rows = Q + t * s_qt + offs_h[:, None] * s_qh
        q = tl.load(q_rows + offs_d[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
        qp = tl.load(q_rows + partner[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
        cos = tl.load(CS + t * s_ct + offs_d, mask=roped, other=1.0).to(tl.float32)
        sin = tl.load(CS + t * s_ct + s_c1 + offs_d, mask=roped, other=0.0).to(tl.float32)
        q = q * cos[None, :] + qp * sin[None, :]
        if UPCAST:  # Triton's CPU interpreter gets bf16 tl.dot wrong: compute in fp32 there
            q_t = tl.trans(q)
        else:
            q_t = tl.trans(q.to(KEYS.dtype.element_ty))  # [D, BLOCK_H]
        w = tl.load(WTS + t * s_wt + offs_h, mask=hmask, other=0.0) * head_scale
        hist = tl.zeros([256], tl.int32)
        for l0 in range(start, end, BLOCK_L):
            offs_l = l0 + tl.arange(0, BLOCK_L)
            lmask = offs_l < end
            keys = tl.load(KEYS + offs_l.to(tl.int64)[:, None] * s_kl + offs_d[None, :], mask=lmask[:, None], other=0.0)
            if UPCAST:
                keys = keys.to(tl.float32)
            s = tl.dot(keys, q_t, input_precision=PRECISION)  # [BLOCK_L, BLOCK_H]: all heads of the row per key read
            s = tl.maximum(s * qk_scale, 0.0)
            score = tl.sum(s * w[None, :], axis=1)
            ok = tl.load(VALID + t * s_vt + offs_l, mask=lmask, other=0) != 0
            score = tl.where(ok, score, float("-inf"))
            tl.store(OUT + t * s_ot + offs_l, score, mask=lmask)
            if WITH_HIST:  # dsa_topk's first radix pass, over the scores still in registers
                hist += _masked_hist(_digit(_ordered_key(score), 0), lmask, 256, BLOCK_L)
        if WITH_HIST:
            bins = tl.arange(0, 256)
            tl.atomic_add(HIST + t * s_ht + bins, hist, mask=hist > 0, sem="relaxed")  # read after the kernel boundary
        trigger(PDL)  # pdl.py: the late form triggers here


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
                            D=d, ROPE=rope, INTERLEAVED=interleaved, num_warps=1, **pdl.launch_args(kx, "dsa"))


def score_chunk(length: int) -> int:
    """Keys per program of the scores kernel: a multiple of block_l giving about TUNE["programs"] programs a row, so each
    program ropes its q once for many keys and the grid still fills the GPU."""
    block_l = TUNE["block_l"]
    blocks = -(-length // block_l)
    return block_l * max(1, -(-blocks // TUNE["programs"]))


def index_scores(q: torch.Tensor, cs: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                 rope: int, interleaved: bool, hist: torch.Tensor | None = None) -> torch.Tensor:
    """[T, L] float32 indexer scores: sum_h weights[t, h] * n_heads^-0.5 * relu(rope(q[t, h]) . keys[l] * d^-0.5),
    -inf where valid [T, L] is not set. q [T, H, D] un-roped (wq_b . q_resid); weights [T, H] float32;
    keys: the cache (its first L rows are read, each once for all heads and, with T > 1, all rows from L2).
    hist: a zeroed int32 [T, >= 256] that gets each row's histogram of the scores' top radix byte
    (dsa_topk.topk_select's first pass, so the select skips it)."""
    _need_triton()
    t, h, d = q.shape
    length = valid.shape[1]
    if keys.shape[1] != d or keys.stride(1) != 1 or q.stride(2) != 1 or cs.stride(2) != 1 or keys.shape[0] < length:
        raise ValueError(f"DSA index scores: q {tuple(q.shape)}, keys {tuple(keys.shape)} (stride {keys.stride()}), window {length}")
    if weights.dtype != torch.float32 or weights.shape != (t, h):
        raise ValueError(f"DSA index scores: weights {tuple(weights.shape)} {weights.dtype}, expected ({t}, {h}) torch.float32")
    if hist is not None and (hist.dtype != torch.int32 or hist.shape[0] != t or hist.shape[1] < 256 or hist.stride(1) != 1):
        raise ValueError(f"DSA index scores: hist {tuple(hist.shape)} {hist.dtype}, expected contiguous ({t}, >= 256) torch.int32")
    if valid.stride(1) != 1:
        valid = valid.contiguous()
    weights = weights.contiguous()
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    chunk = score_chunk(length)
    _index_scores_kernel[(t, triton.cdiv(length, chunk))](
        q, cs, weights, keys, valid.view(torch.uint8), out, out if hist is None else hist, h, length, chunk, d**-0.5, h**-0.5,
        q.stride(0), q.stride(1), cs.stride(0), cs.stride(1), weights.stride(0), keys.stride(0), valid.stride(0), out.stride(0),
        0 if hist is None else hist.stride(0),
        D=d, ROPE=rope, INTERLEAVED=interleaved, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_L=TUNE["block_l"],
        PRECISION="ieee" if keys.dtype == torch.float32 else "tf32", UPCAST=_INTERPRET and keys.dtype != torch.float32,
        WITH_HIST=hist is not None, num_warps=TUNE["num_warps"], num_stages=TUNE["num_stages"], **pdl.launch_args(q, "dsa"))
    return out


def index_topk(q: torch.Tensor, cs: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
               rope: int, interleaved: bool, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """index_scores then dsa_topk.topk_select's k best slots (idx [T, k] int64, ok [T, k] bool), the select's first
    radix pass fused into the scores kernel: 5 launches (memset, scores, split, refine, finish) whatever the window;
    dsa_topk.TUNE's fused_finish and scratch take the finish and the memset out."""
    from tilepd.engine import dsa_topk

    kept = bool(dsa_topk.TUNE["scratch"])
    hist = dsa_topk.scratch(q.shape[0], q.device) if kept else dsa_topk.new_hist(q.shape[0], q.device)
    try:
        return dsa_topk.topk_select(index_scores(q, cs, weights, keys, valid, rope, interleaved, hist=hist), valid, k, hist=hist, clean=kept)
    except BaseException:
        if kept:  # a launch refused after the scores' histogram went in: the kept scratch must be zero for the next call
            hist.zero_()
        raise
